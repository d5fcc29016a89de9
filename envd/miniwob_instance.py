"""The MiniWoB++ package's browser instance (miniwob.selenium_instance.SeleniumInstance) as envd runs it: launched
through envd.miniwob_chromium.ChromiumProcess (flags, a sandbox, timeouts), and reading the page in fewer
WebDriver round trips.

Each WebDriver command is an HTTP request to chromedriver, a DevTools call into Chromium and a task for the page's
renderer: ~5 ms of CPU spread over four processes. The package reads a step's result in three scripts (the reward
globals, the utterance, the DOM) and a reset's in three more; here each is one script returning all three
(`read`), with the package's own page API (core.getUtterance, core.getDOMInfo, the WOB_* globals) and its own
observation builders, so what a step returns is unchanged: a click-checkboxes episode (a Reset and 3 steps) makes 8
fewer WebDriver calls (25 -> 17).
"""
from __future__ import annotations

import time
from typing import Any

from envd.miniwob_chromium import ChromiumProcess

# One script: the package's get_metadata globals, and the utterance and DOM of get_observation unless the episode
# is over (a step's result then carries the package's empty observation, as SeleniumInstance.step does).
READ_ALL = ("const meta = {done: WOB_DONE_GLOBAL, env_reward: WOB_REWARD_GLOBAL, raw_reward: WOB_RAW_REWARD_GLOBAL, "
            "reason: WOB_REWARD_REASON};"
            "if (meta.done && arguments[0]) return {meta: meta};"
            "return {meta: meta, utterance: core.getUtterance(), dom: core.getDOMInfo()};")


def wait_for_task_page(driver, url: str, timeout_s: float) -> None:
    """Wait until a just-loaded task page shows MiniWoB's sync screen (its scripts have run)."""
    from miniwob.selenium_instance import SeleniumInstance
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.wait import WebDriverWait

    try:
        WebDriverWait(driver, timeout_s).until(EC.element_to_be_clickable((By.ID, SeleniumInstance.SYNC_SCREEN_ID)))
    except TimeoutException:
        raise RuntimeError(f"MiniWoB page {url} did not load") from None


def instance_class():
    from miniwob.dom import DOMElement
    from miniwob.observation import create_empty_screenshot, create_observation
    from miniwob.screenshot import get_screenshot, pil_to_numpy_array
    from miniwob.selenium_instance import SeleniumInstance

    class ChromiumInstance(SeleniumInstance):
        """SeleniumInstance whose driver is a ChromiumProcess (the package's own launch has no way to add flags,
        a sandbox or timeouts), reading a reset's and a step's result in one script (the module docstring)."""

        def __init__(self, *, browser: ChromiumProcess, **kwargs):
            self.browser = browser
            super().__init__(**kwargs)

        def create_driver(self):
            self.driver = self.browser.start((self.window_width, self.window_height))
            self.driver.implicitly_wait(5)
            self.driver.get(self.url)
            wait_for_task_page(self.driver, self.url, self.browser.command_timeout_s)
            # Headless windows lose ~160 px to (invisible) browser UI: grow the window until the viewport holds the
            # page the task expects, else the screenshot has a black band and clicks there fall off the page.
            for _ in range(3):
                self.inner_width, self.inner_height = self.driver.execute_script(
                    "return [window.innerWidth, window.innerHeight];")
                short_w, short_h = self.window_width - self.inner_width, self.window_height - self.inner_height
                if short_w <= 0 and short_h <= 0:
                    break
                size = self.driver.get_window_size()
                self.driver.set_window_size(size["width"] + max(0, short_w), size["height"] + max(0, short_h))

        def close(self):
            self.browser.stop()
            self.died = True

        # ---- reading the page: one script where the package runs three -----------------------------------
        def read(self, use_cached_fields: bool, empty_when_done: bool) -> tuple[dict, Any, dict]:
            """(metadata, observation or None when the episode is over and empty_when_done, extra metadata): one
            WebDriver call (and the screenshot when recorded). Also MiniWoBEnv.observe's read."""
            r = self.driver.execute_script(READ_ALL, empty_when_done)
            meta = r["meta"]
            if "dom" not in r:
                return meta, None, {}
            response = r["utterance"]
            utterance = response["utterance"] if isinstance(response, dict) else response
            if not use_cached_fields:
                self.cached_fields = (list(response["fields"].items()) if isinstance(response, dict)
                                      else self.field_extractor(utterance))
            root = DOMElement(r["dom"])
            if self.record_screenshots:
                img = pil_to_numpy_array(get_screenshot(self.driver, true_width=self.inner_width,
                                                        true_height=self.inner_height, crop_width=self.task_width,
                                                        crop_height=self.task_height))
            else:
                img = create_empty_screenshot(self.task_width, self.task_height)
            return meta, create_observation(utterance, root, img, self.cached_fields), {"root_dom": root}

        def reset(self, obs: list[Any], infos: list[Any], seed: Any):
            i = self.index
            self.force_stop()
            self.begin_task(seed=seed)
            meta, obs[i], extra = self.read(use_cached_fields=False, empty_when_done=False)
            infos[i] = {**meta, **extra}

        def step(self, action, action_space_config, obs: list[Any], rewards: list[Any], dones: list[Any],
                 infos: list[Any]):
            i = self.index
            self.perform(action, action_space_config)
            meta, ob, extra = self.read(use_cached_fields=True, empty_when_done=True)
            rewards[i] = self.reward_processor(meta)
            dones[i] = meta["done"]
            obs[i] = ob if ob is not None else self.get_empty_observation()
            infos[i] = {**meta, "elapsed": max(0.0, time.time() - self.start_time), **extra}

    return ChromiumInstance
