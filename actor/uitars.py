"""UI-TARS as a vision-language checkpoint speaks it: the prompt, the screenshots as images, its coordinates.

For a Qwen2-VL / Qwen2.5-VL checkpoint (core.vlm.is_vl_dir on the tokenizer's directory) an episode on a GUI task
(env ids under GUI_PREFIXES) runs the way UI-TARS-1.5 was trained:

- system prompt: the UI-TARS computer-use prompt and action space (actor/prompts.py, the task's instruction inside
  it), with points in UI-TARS-1.5's form point='<point>x y</point>' (absolute coordinates) or UI-TARS-1.0's
  start_box='(x,y)' (relative ones); actor.system_prompt picks another (tiny, browser, mobile, none, ...).
- each turn's user message is the screenshot alone (the env's text is not shown: UI-TARS reads the pixels), as an
  image run of VLSpec.image_tokens(w, h) pads that core.chat frames with <|vision_start|>/<|vision_end|>; an
  observation without a screenshot is shown as text (and the tiny prompt's turns as before, with the image first).
- coordinates go back to the screen with `to_screen`: the model saw the screenshot after smart_resize at the
  checkpoint processor's limits, so "absolute" (UI-TARS-1.5, the default) divides by that resized size; "relative"
  (UI-TARS-1.0) is 0..1000 per axis (actor.coordinates).
- at most k = actor.image_history screenshots per segment; the (k+1)-th starts a new segment (the VL contract,
  docs/actor.md): a fresh first prompt with the earlier turns' thoughts and actions as text (`history_text`) and the
  new screenshot.

Text checkpoints and the tiny `tars_vision` path keep their own rules (actor/tiny.py, actor/episode.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from actor.parsing import from_screen, on_screen
from actor.tiny import UITARS_PROMPTS, format_action
from core.action import Action
from core.chat import ChatTokenizer, Content
from core.session_options import SCREENSHOTS, split_screenshots
from core.vlm import IMAGE_FACTOR, MAX_PIXELS, MIN_PIXELS, VLSpec, is_vl_dir, png_size

# Env id prefixes whose tasks are a screen to act on: a VL checkpoint gets the UI-TARS prompt there by default.
GUI_PREFIXES = ("builtin", "miniwob", "browser", "desktop", "hybrid")
UITARS_STYLES = UITARS_PROMPTS
COORDINATES = ("auto", "absolute", "relative", "screen")
VL_IMAGE_HISTORY = 5      # actor.image_history -1 (auto) for a VL checkpoint: UI-TARS keeps about 5 screenshots


@dataclass(frozen=True)
class Vision:
    """An actor's resolved image and coordinate settings (from its config and its checkpoint)."""

    spec: VLSpec | None   # the checkpoint's image facts; None for a text or tars_vision checkpoint
    image_history: int    # screenshots per segment (VL) / in the engine's window (tars_vision); 0 = none
    coordinates: str      # absolute | relative | screen

    @property
    def vl(self) -> bool:
        return self.spec is not None

    def style(self, configured: str, env_id: str) -> str:
        """The system prompt style of an episode: `auto` is the UI-TARS computer-use prompt for a VL checkpoint on
        a GUI task, else tiny."""
        if configured != "auto":
            return configured
        gui = env_id.split("/", 1)[0] in GUI_PREFIXES
        return "computer" if self.vl and gui else "tiny"

    def point_form(self) -> str:
        # UI-TARS-1.5 writes absolute points as <point>x y</point>; 1.0 relative boxes as (x,y).
        return "point" if self.coordinates == "absolute" else "box"

    def tokens(self, png: bytes) -> int:
        """Image pads of one screenshot: the checkpoint's own count for its size (ValueError if unreadable)."""
        assert self.spec is not None
        w, h = png_size(png)
        return self.spec.image_tokens(w, h)

    def to_screen(self, actions: list[Action], screen: tuple[int, int], shot: bytes) -> list[Action]:
        """The actions with their points mapped from model coordinates to screen pixels. `screen`: the observation's
        (width, height) (0s when the env did not say: the screenshot's own size); `shot`: the screenshot the model
        saw (its real size is what smart_resize resized). Unchanged in `screen` mode, or with no size to map to."""
        frame = self._frame(screen, shot)
        if frame is None:
            return actions
        sw, sh, iw, ih, lim = frame
        return [on_screen(a, self.coordinates, sw, sh, iw, ih, **lim) for a in actions]

    def to_model(self, actions: list[Action], screen: tuple[int, int], shot: bytes) -> list[Action]:
        """to_screen's inverse: points in screen pixels -> the model's coordinates, rounded to whole units as a model
        writes them (a demonstrator's answer)."""
        frame = self._frame(screen, shot)
        if frame is None:
            return actions
        sw, sh, iw, ih, lim = frame
        def back(p):
            return tuple(float(round(v)) for v in from_screen(p, self.coordinates, sw, sh, iw, ih, **lim))
        return [a.map_points(back) for a in actions]

    def _frame(self, screen: tuple[int, int], shot: bytes):
        """(screen w, h, screenshot w, h, resize limits) the coordinate maps take, or None where points stay as they
        are (screen mode, or no size to map to)."""
        if self.coordinates == "screen":
            return None
        img = png_size(shot) if shot else None
        sw, sh = screen if screen[0] > 0 and screen[1] > 0 else (img or (0, 0))
        if sw <= 0 or sh <= 0:
            return None
        iw, ih = img or (sw, sh)
        spec = self.spec
        lim = ({"factor": spec.factor, "min_pixels": spec.min_pixels, "max_pixels": spec.max_pixels} if spec else
               {"factor": IMAGE_FACTOR, "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS})
        return sw, sh, iw, ih, lim

    def demo_answer(self, style: str, action: Action, screen: tuple[int, int], shot: bytes) -> str:
        """What a policy in `style` should write to take a demonstrator's `action` (screen pixels) on an observation
        (screen size, screenshot). The text styles, which show the element list, name the element as the action
        does (format_action). The UI-TARS styles show a screenshot alone: the action at its point, in the
        checkpoint's point form, a type into a named field as a click on the field and then the type. Points are
        written in the model's coordinates (to_model: the actor maps every answer's points back with to_screen).
        ValueError for a UI-TARS answer to an action that names an element without a point (the backend could not
        ground it: envd.hints.grounded)."""
        acts, form, label = [action], "box", ""
        if style in UITARS_STYLES and shot:
            if action.target and action.point is None:
                raise ValueError(f"the demonstrator's {action.type} names {action.target!r} but has no point on the "
                                 "screen: the backend cannot ground it, so a screenshot policy cannot be shown it")
            acts = ([Action("click", point=action.point), Action("type", content=action.content)]
                    if action.type == "type" and action.target else [replace(action, target="")])
            form, label = self.point_form(), "Action: "
        return label + "\n".join(format_action(a, form) for a in self.to_model(acts, screen, shot))


def resolve(cfg, tok: ChatTokenizer, spec: VLSpec | None = None) -> Vision:
    """The Vision of an actor config and its tokenizer/checkpoint directory; ValueError for bad settings or a VL
    checkpoint that cannot show images (no processor config, no vision tokens in the tokenizer)."""
    if cfg.coordinates not in COORDINATES:
        raise ValueError(f"actor.coordinates must be one of {COORDINATES}, got {cfg.coordinates!r}")
    if cfg.image_history < -1:
        raise ValueError(f"actor.image_history must be -1 (auto) or >= 0, got {cfg.image_history}")
    if spec is None and tok.path and is_vl_dir(tok.path):
        spec = VLSpec.load(tok.path)
    if spec is not None and tok.vision_start_id < 0:
        raise ValueError(f"{tok.path}: a vision-language checkpoint whose tokenizer has no <|vision_start|> / "
                         "<|image_pad|> tokens")
    k = images_shown(cfg, spec is not None)
    # auto: what the checkpoint's family answers in: Qwen2-VL / UI-TARS-1.0 thousandths of the screen, Qwen2.5-VL /
    # UI-TARS-1.5 pixels of the resized screenshot, a text checkpoint the screen's own pixels.
    coords = cfg.coordinates if cfg.coordinates != "auto" else (
        "screen" if spec is None else "relative" if spec.model_type == "qwen2_vl" else "absolute")
    return Vision(spec, k, coords)


def images_shown(cfg, vl: bool) -> int:
    """actor.image_history resolved for a vision-language checkpoint (vl) or a text one; ValueError when
    actor.env_options turns screenshots off (envd's session option) for a policy that is shown some."""
    k = cfg.image_history if cfg.image_history >= 0 else (VL_IMAGE_HISTORY if vl else 0)
    if k > 0 and not split_screenshots({str(a): str(b) for a, b in (cfg.env_options or {}).items()})[1]:
        why = "-1 (auto) for a vision-language checkpoint" if cfg.image_history < 0 else str(k)
        raise ValueError(f"actor.env_options.{SCREENSHOTS} is off, but the policy is shown screenshots "
                         f"(actor.image_history {why}): turn screenshots on, or set actor.image_history=0")
    return k


def session_options(cfg, vis: Vision) -> dict[str, str]:
    """actor.env_options as the actor creates its sessions with: envd's `screenshots` option turned off when nothing
    of the episode reads a screenshot (a policy shown none, resolved in `vis`, and no judge), unless the config sets
    it. A screenshot cost the backend a capture, envd an encode and the stream its bytes on every step, and the
    learner a place in its image store, for a text policy that never read it (a MiniWoB++ episode through envd: 0.30
    CPU-s without, 0.39 with); `screenshots: "1"` keeps them (trajectories to look at, or to train a VL model on)."""
    opts = {str(k): str(v) for k, v in (cfg.env_options or {}).items()}
    if SCREENSHOTS not in opts and vis.image_history == 0 and cfg.judge_mode == "off":
        opts[SCREENSHOTS] = "0"
    return opts


def system_text(style: str, instruction: str, point_form: str) -> Content:
    """The system prompt of a style: a UI-TARS prompt's parts (actor.prompts.system_parts), or actor.tiny.system_prompt
    for the non-UI-TARS ones."""
    if style in UITARS_STYLES:
        from actor.prompts import system_parts

        return system_parts(style, instruction, point_form=point_form)
    from actor.tiny import system_prompt

    return system_prompt(style, instruction)


def history_text(steps: list[str], skip: int = 0) -> str:
    """Earlier turns' thoughts and actions, for the first prompt of a new segment; the first `skip` left out (the
    context cannot hold them), the rest keep their step numbers."""
    kept = steps[skip:]
    if not kept:
        return f"Previous steps: {skip} (left out)\n\n" if skip else ""
    gap = f"(steps 1-{skip} left out)\n\n" if skip else ""
    return "Previous steps:\n" + gap + "\n\n".join(f"Step {i}:\n{s}" for i, s in enumerate(kept, skip + 1)) + "\n\n"


def stray(ids: list[int], vision: frozenset) -> int:
    """Index of the first image token (VL vision token, tars_vision placeholder) in an answer, or -1."""
    return next((i for i, t in enumerate(ids) if t in vision), -1) if vision else -1


def step_text(thought: str, actions: list[Action] | None, output: str) -> str:
    """One turn as history text: its thought and its actions as written (an unparseable answer is named so)."""
    if actions is None:
        return f"(an answer that was not a valid action: {output.strip()[:200]!r})"
    acts = "\n".join(a.raw for a in actions)
    return f"Thought: {thought}\nAction: {acts}" if thought else f"Action: {acts}"
