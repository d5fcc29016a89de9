"""`browser`: a Chromium page per session, driven with UI-TARS actions (env id `browser`).

Every session is a BrowserContext (own cookies, storage, cache) with one page in the daemon's single Chromium
(envd/browser_host.py). The blocking Env methods below run in envd's worker threads and submit coroutines to the
browser thread, each with a deadline. Options are in envd/browser_input.BrowserOptions; docs/envd-browser.md has
the user-facing summary.

Errors: a malformed action, or a target label that matches no (or several) visible elements, raises ActionError
before the page is touched. Anything else (a dead browser, a crashed page, a deadline) is an infrastructure failure
and ends the session as INFRA_ERROR.

Observation: a viewport screenshot (taken over CDP, without Playwright's font and animation waits) and a text
of `url:`, `title:` and the page's accessibility (aria) snapshot: role, name and value per node, cut at
max_text_chars.
"""
from __future__ import annotations

import asyncio
import base64
import json
import math
import time
from typing import Any

from envd.base import Action, ActionError, Env, Outcome, Resources, Screenshot, StepResult, call_time_left
from envd.browser_host import BrowserGone, BrowserHost
from envd.browser_input import POINTED, BrowserOptions, Checked, check_action, check_url, url_allowed

HOST = BrowserHost()  # one Chromium per daemon process (registry factories share it)
SNAPSHOT_FORMAT = "tars.browser/1"
# Roles a `target` label is matched against first (accessible name, exact); plain text, labels, placeholders, alt
# and title attributes come second.
_TARGET_ROLES = ("button", "link", "textbox", "searchbox", "checkbox", "radio", "switch", "combobox", "listbox",
                 "option", "menuitem", "menuitemcheckbox", "menuitemradio", "tab", "treeitem", "slider", "spinbutton",
                 "cell", "gridcell", "heading", "img")
_PAGE_STATE_JS = "typeof window.__tars_get_state === 'function' ? window.__tars_get_state() : null"


class BrowserEnv(Env):
    env_id = "browser"
    # An estimate for the host budget: a BrowserContext's renderer and helper processes in the shared Chromium.
    # No disk: a context is off the record (cache and storage in memory) and takes no downloads.
    claim = Resources(pids=16, memory_mb=512)
    action_space = ("click/left_double/right_single(point=[x,y] | target=LABEL), drag(point, end_point), "
                    "hotkey(key='ctrl a'), type(content; a trailing \\n presses Enter), "
                    "scroll(point, direction=up|down|left|right), wait(), finished(content), call_user()")
    snapshot_kind = "browser"
    restores_url = True  # a snapshot reopens the page it was on (games always reopen their own page)

    def __init__(self, options: dict[str, str] | None = None, host: BrowserHost | None = None):
        self.host = host or HOST
        self._raw = dict(options or {})
        self.opts = self._options(self._raw)             # ValueError -> INVALID_ARGUMENT at CreateSession
        self.browser, self.generation = self.host.acquire(timeout=self.host.launch_timeout_s + 10)
        self._released = False
        self.context = self.page = self.cdp = None
        self._crashed = False
        self.steps = 0
        self.outcome = Outcome.RUNNING
        self.last_verify: dict[str, Any] = {}

    def _options(self, raw: dict[str, str]) -> BrowserOptions:
        return BrowserOptions.parse(raw)

    # ---- the Env contract (worker threads) --------------------------------------------------------------------
    def reset(self, seed: int, options: dict[str, str] | None = None) -> StepResult:
        raw = {**self._raw, **(options or {})}
        opts = self._options(raw)
        return self._call(self._reset, opts, raw, seed, None, timeout=opts.timeout_s)

    def step(self, action: Action) -> StepResult:
        if self.page is None:
            raise ActionError("no page yet: Reset the session first")
        return self._call(self._step, check_action(action, self.opts.width, self.opts.height))

    def observe(self) -> StepResult:
        if self.page is None:
            raise NotImplementedError("nothing to observe before the first reset")
        return self._call(self._observe)

    def snapshot(self) -> bytes:
        if self.page is None:
            raise ActionError("nothing to snapshot before the first reset")
        return json.dumps(self._call(self._snapshot)).encode()

    def restore(self, state: bytes) -> StepResult:
        snap = self._parse_snapshot(state)
        opts = self._options(snap["options"])  # the same checks as options given at CreateSession
        if snap["url"] and not opts.html:
            try:
                check_url(snap["url"], opts.allow_any_url, top_level=True)
            except ValueError as e:
                raise ActionError(f"snapshot: {e}") from None
        return self._call(self._reset, opts, snap["options"], 0, snap, timeout=opts.timeout_s)

    def close(self) -> None:
        if self._released:
            return
        try:
            if self.context is not None and self.host.alive(self.generation):
                self._call(self._close_context)
        finally:
            self._released = True
            self.host.release()

    def _call(self, fn, *args, timeout: float | None = None):
        if self._released:
            raise BrowserGone("the session is closed")
        # Never past envd's deadline for this call: a page call hung up to timeout_s (600 s allowed) kept the worker.
        return self.host.call(fn, *args, timeout=call_time_left(timeout or self.opts.timeout_s))

    # ---- coroutines (browser thread) --------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if not self.host.alive(self.generation):
            raise BrowserGone("the browser process behind this session died or was shut down")
        if self._crashed:
            raise BrowserGone("the page's renderer crashed")

    async def _close_context(self) -> None:
        ctx, self.context, self.page, self.cdp = self.context, None, None, None
        if ctx is not None:
            await ctx.close()

    async def _reset(self, opts: BrowserOptions, raw: dict[str, str], seed: int, snap: dict | None) -> StepResult:
        self._check_alive()
        old = self.opts, self._raw
        try:
            return await self._start(opts, raw, seed, snap)
        except BaseException:
            # A refused or failed reset leaves no half-made episode: no page (a Step says "Reset first") and the
            # options of the last good reset (what a snapshot or a later Reset without options builds on).
            self.opts, self._raw = old
            try:
                await asyncio.wait_for(self._close_context(), 5.0)
            except Exception:
                self.context = self.page = self.cdp = None
            raise

    async def _start(self, opts: BrowserOptions, raw: dict[str, str], seed: int, snap: dict | None) -> StepResult:
        await self._close_context()
        self.opts, self._raw, self._crashed = opts, dict(raw), False
        try:
            ctx = await self.browser.new_context(
                viewport={"width": opts.width, "height": opts.height}, device_scale_factor=1,
                storage_state=snap["storage"] if snap else None, service_workers="block", accept_downloads=False)
        except Exception as e:
            if type(e).__name__ != "TargetClosedError":
                raise
            self.host.lost(self.generation)  # the next session gets a new browser
            raise BrowserGone(f"the browser behind this session is gone: {str(e).splitlines()[0]}") from None
        self.context = ctx
        ctx.set_default_timeout(opts.timeout_s * 800)  # ms, inside the call's own deadline
        if not opts.allow_any_url:
            await ctx.route("**/*", self._gate)
        page = await ctx.new_page()
        page.on("crash", lambda _: setattr(self, "_crashed", True))
        self.page, self.cdp = page, await ctx.new_cdp_session(page)
        await self._before_load(page)
        url = snap["url"] if snap and self.restores_url else opts.url
        if opts.html:
            await page.set_content(opts.html, wait_until="load")
        elif url and url != "about:blank":
            await page.goto(url, wait_until="load")
        await self._prepare(seed, snap)
        self.steps, self.outcome = (int(snap["step"]), Outcome(snap["outcome"])) if snap else (0, Outcome.RUNNING)
        if opts.verify_js:
            # Once now: checks the expression (a broken verifier is a bad option) and sets a reward baseline.
            try:
                self.last_verify = await self._verify()
            except RuntimeError as e:
                raise ValueError(f"verify_js: {e}") from None
        return await self._result(0.0, self.outcome, {})

    async def _before_load(self, page) -> None:
        """Hook before the page loads (games install their clock here)."""

    async def _prepare(self, seed: int, snap: dict | None) -> None:
        """After the page loaded: put back what a snapshot holds (games also reset their game and clock here)."""
        if snap is None:
            return
        if snap.get("page_state") is not None:
            await self.page.evaluate("s => window.__tars_set_state && window.__tars_set_state(s)", snap["page_state"])
        sx, sy = snap.get("scroll") or (0, 0)
        if sx or sy:
            await self.page.evaluate("([x, y]) => window.scrollTo(x, y)", [sx, sy])

    async def _gate(self, route) -> None:
        # Default containment: nothing but loopback and local schemes, for navigations and sub-resources alike.
        if url_allowed(route.request.url, False):
            await route.fallback()
        else:
            await route.abort("blockedbyclient")

    async def _step(self, c: Checked) -> StepResult:
        self._check_alive()
        t, info = c.action.type, {}
        if t == "finished":
            info["answer"] = c.action.content
        elif t == "call_user":
            info["call_user"] = True
        else:
            await self._act_and_settle(c)
        reward, done = 0.0, False
        if self.opts.verify_js:
            self.last_verify = await self._verify()
            reward, done = self.last_verify["reward"], self.last_verify["done"]
            info["verify"] = self.last_verify
        self.steps += 1
        ended = done or t in ("finished", "call_user")
        self.outcome = (Outcome.TERMINATED if ended else Outcome.TRUNCATED if self.steps >= self.opts.max_steps
                        else Outcome.RUNNING)
        return await self._result(reward, self.outcome, info)

    async def _observe(self) -> StepResult:
        self._check_alive()
        return await self._result(0.0, self.outcome, {"verify": self.last_verify} if self.last_verify else {})

    async def _act_and_settle(self, c: Checked) -> None:
        """Apply the action, then let the page react for settle_ms (wait_ms for wait()) and finish loading."""
        point = await self._point(c.action)
        await self._input(c, point)
        wait = self.opts.wait_ms if c.action.type == "wait" else self.opts.settle_ms
        if wait:
            await asyncio.sleep(wait / 1000)
        await self.page.wait_for_load_state("load")

    async def _point(self, a: Action) -> tuple[float, float] | None:
        """Where the action lands: its point, else its target's centre (ActionError before any input), else (for
        scroll) the middle of the viewport."""
        if a.point is not None:
            return a.point
        if a.target and a.type != "hotkey":
            return await self._target_point(a.target)
        if a.type == "scroll":
            return self.opts.width / 2, self.opts.height / 2
        return None

    async def _input(self, c: Checked, point: tuple[float, float] | None) -> None:
        page, a = self.page, c.action
        t = a.type
        if t in POINTED:
            if t == "left_double":
                await page.mouse.dblclick(*point)
            else:
                await page.mouse.click(*point, button="right" if t == "right_single" else "left")
        elif t == "drag":
            await page.mouse.move(*point)
            await page.mouse.down()
            await page.mouse.move(*a.end_point, steps=4)
            await page.mouse.up()
        elif t == "hotkey":
            await page.keyboard.press(c.keys)
        elif t == "type":
            if point is not None:
                await page.mouse.click(*point)
            text = a.content
            body = text.rstrip("\n")
            if body:
                await page.keyboard.type(body)
            if body != text:
                await page.keyboard.press("Enter")
        elif t == "scroll":
            await page.mouse.move(*point)
            d, n = a.direction, self.opts.scroll_px
            await page.mouse.wheel(n if d == "right" else -n if d == "left" else 0,
                                   n if d == "down" else -n if d == "up" else 0)

    async def _target_point(self, target: str) -> tuple[float, float]:
        """Centre of the one visible element named `target`; ActionError if none or several."""
        page = self.page
        by_role = None
        for r in _TARGET_ROLES:
            loc = page.get_by_role(r, name=target, exact=True)
            by_role = loc if by_role is None else by_role.or_(loc)
        by_text = (page.get_by_label(target, exact=True).or_(page.get_by_text(target, exact=True))
                   .or_(page.get_by_placeholder(target, exact=True)).or_(page.get_by_alt_text(target, exact=True))
                   .or_(page.get_by_title(target, exact=True)))
        for loc in (by_role, by_text):
            loc = loc.filter(visible=True)
            n = await loc.count()
            if n > 1:
                raise ActionError(f"{n} visible elements match target {target!r}; use a point instead")
            if n == 1:
                box = await loc.bounding_box()
                if box and not self._box_in_view(box):
                    # By script, without Playwright's actionability waits: we only want the box in view.
                    await loc.evaluate("e => e.scrollIntoView({block: 'center', inline: 'center'})")
                    box = await loc.bounding_box()
                if not box or box["width"] <= 0 or box["height"] <= 0 or not self._box_in_view(box):
                    raise ActionError(f"target {target!r} has no clickable box in the viewport")
                return box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
        raise ActionError(f"no visible element is named {target!r}")

    def _box_in_view(self, box: dict) -> bool:
        cx, cy = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
        return 0 <= cx < self.opts.width and 0 <= cy < self.opts.height

    async def _verify(self) -> dict[str, Any]:
        """Evaluate verify_js -> {reward, done, ...}; RuntimeError (infra) if it throws or returns something else."""
        for attempt in (0, 1):
            try:
                v = await self.page.evaluate(self.opts.verify_js)
                break
            except Exception as e:
                if attempt == 0 and "context was destroyed" in str(e):
                    await self.page.wait_for_load_state("load")  # a navigation raced the evaluation: once more
                    continue
                raise RuntimeError(f"verifier threw: {str(e).splitlines()[0]}") from None
        if not isinstance(v, dict):
            raise RuntimeError(f"verifier returned {type(v).__name__}, not an object {{reward, done}}")
        try:
            reward = float(v.get("reward", 0.0) or 0.0)
        except (TypeError, ValueError):
            raise RuntimeError(f"verifier reward {v.get('reward')!r} is not a number") from None
        if not math.isfinite(reward):
            raise RuntimeError(f"verifier reward {reward} is not finite")
        return {**v, "reward": reward, "done": bool(v.get("done", False))}

    async def _render(self) -> tuple[list[Screenshot], str]:
        o = self.opts
        params: dict[str, Any] = {"format": o.format, "captureBeyondViewport": False}
        if o.format == "jpeg":
            params["quality"] = o.quality
        shots = []
        if self.screenshots:
            shot = await self._capture(params)
            shots.append(Screenshot(base64.b64decode(shot["data"]), f"image/{o.format}", o.width, o.height))
        aria = await self.page.aria_snapshot(boxes=o.boxes)
        title = await self.page.title()
        text = f"url: {self.page.url}\ntitle: {title}\n{aria}"
        if len(text) > o.max_text_chars:
            text = text[:o.max_text_chars - 40].rstrip() + f"\n... (cut at {o.max_text_chars} of {len(text)} chars)"
        return shots, text

    async def _capture(self, params: dict) -> dict:
        """Page.captureScreenshot, retried while a navigation is in flight: a navigation that swaps the renderer
        (another site, or Chromium's error page for a blocked request) detaches the CDP session ("Not attached to an
        active page", so attach a new one), and a frame between two documents answers "Unable to capture
        screenshot" until the new one is painted. Other errors, and the last attempt's, go to the caller."""
        o = self.opts
        deadline = time.monotonic() + o.timeout_s
        for attempt in range(5):
            try:
                return await asyncio.wait_for(self.cdp.send("Page.captureScreenshot", params),
                                              max(0.1, deadline - time.monotonic()))
            except Exception as e:
                msg = str(e)
                transient = "Not attached to an active page" in msg or "Unable to capture screenshot" in msg
                if not transient or attempt == 4 or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05 * (attempt + 1))
                await self.page.wait_for_load_state("load")
                if "Not attached" in msg:
                    self.cdp = await self.context.new_cdp_session(self.page)
        raise AssertionError("unreachable")

    async def _result(self, reward: float, outcome: Outcome, info: dict) -> StepResult:
        shots, text = await self._render()
        return StepResult(text=text, instruction=self.opts.instruction, reward=reward, outcome=outcome,
                          images=shots, info=info, width=self.opts.width, height=self.opts.height, step=self.steps)

    # ---- snapshots -------------------------------------------------------------------------------------------
    async def _snapshot(self) -> dict:
        self._check_alive()
        page = self.page
        return {
            "format": SNAPSHOT_FORMAT, "env": self.snapshot_kind, "options": self._raw,
            "url": "" if self.opts.html else page.url, "step": self.steps, "outcome": self.outcome,
            "storage": await self.context.storage_state(indexed_db=True),
            "scroll": await page.evaluate("[window.scrollX, window.scrollY]"),
            "page_state": await page.evaluate(_PAGE_STATE_JS),
        }

    def _parse_snapshot(self, state: bytes) -> dict:
        """The snapshot as a dict, checked field by field (it came back from a client: plain JSON, never code
        we did not already allow through options)."""
        try:
            snap = json.loads(state)
        except (ValueError, UnicodeDecodeError) as e:
            raise ActionError(f"not a browser snapshot: {e}") from None
        if not isinstance(snap, dict) or snap.get("format") != SNAPSHOT_FORMAT:
            raise ActionError(f"not a {SNAPSHOT_FORMAT} snapshot")
        if snap.get("env") != self.snapshot_kind:
            raise ActionError(f"a snapshot of {snap.get('env')!r} cannot be restored into {self.snapshot_kind!r}")
        opts, storage = snap.get("options"), snap.get("storage")
        if not (isinstance(opts, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in opts.items())):
            raise ActionError("snapshot options must be a map of strings")
        if not isinstance(snap.get("url"), str) or not isinstance(snap.get("step"), int) or snap["step"] < 0:
            raise ActionError("snapshot url/step are malformed")
        if snap.get("outcome") not in (Outcome.RUNNING, Outcome.TERMINATED, Outcome.TRUNCATED):
            raise ActionError(f"snapshot outcome {snap.get('outcome')!r} is not an episode state")
        if storage is not None and not (isinstance(storage, dict) and isinstance(storage.get("cookies", []), list)
                                        and isinstance(storage.get("origins", []), list)):
            raise ActionError("snapshot storage is malformed")
        scroll = snap.get("scroll") or [0, 0]
        if not (isinstance(scroll, list) and len(scroll) == 2 and all(isinstance(v, (int, float)) for v in scroll)):
            raise ActionError("snapshot scroll must be [x, y]")
        return snap


def make(name: str, options: dict[str, str]) -> BrowserEnv:
    """Registry factory for env id `browser` (no sub-names)."""
    if name:
        raise KeyError(f"unknown env id 'browser/{name}': the browser backend has no sub-environments")
    return BrowserEnv(options)


def shutdown() -> None:
    """Close the daemon's browser now (it also closes by itself when idle, and at interpreter exit)."""
    HOST.shutdown()
