"""The trajectory stream: actors send finished trajectories to the learner, acked once durable, exactly once.

  messages.py    the wire format: every control message, typed, with its encode and validating decode
  sender.py      actor side: TrajectorySender (asyncio DEALER, credit, outbox, re-sends)
  spool.py       the sender's outbox on disk, for actor restarts
  receiver.py    learner side: TrajectoryReceiver (ROUTER io thread, credit, validation, bounded queue)
  peers.py       the receiver's view of one actor: credit, admitted episodes, and the bounds on HELLO's claims
  durability.py  when an accepted trajectory may be acked: through the WAL, or through the learner's checkpoints
  confirm.py     ack confirmation: actors say which acked ids they forgot, so the learner may forget them too
  wal.py         the write-ahead log (also the learner's trajectory-file format)
  walproc.py     the WAL with its checksum, writes and fdatasync in a writer process, fed through shared memory
  walwriter.py   that writer process: O_DIRECT appends of whole blocks, fdatasync, one request at a time
  images.py      content-addressed screenshots, each sent once per learner connection
  curve.py       CURVE encryption hooks for both sockets

Import from the submodules (core.stream.receiver, core.stream.sender, ...): this package module stays empty, so
reading a WAL file does not load ZeroMQ.
"""
