"""The ground floor: what every role shares (config, wire contracts, rpc, stream, telemetry, model)."""
