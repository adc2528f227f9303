"""The browser of the report's tests and of the docs' screenshots: open a report in headless
Chromium and check it (no console errors, every image loaded); take a full-page screenshot.
``python tests/report/browser.py INDEX.html SHOT.png``. A tool of the tests, not of the package.

A minimal client of the Chrome DevTools Protocol over a pipe (``--remote-debugging-pipe``: the
browser reads NUL-terminated JSON commands on its fd 3 and writes replies and events on fd 4), so it
needs no Python package and no network port. Every wait has a deadline, and the browser is killed on
every exit path.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BINARIES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
INSTALL_HINT = "apt-get install -y chromium"
WIDTH, HEIGHT = 1280, 900
MAX_SCREENSHOT_HEIGHT = 16_000  # px; Chromium refuses far taller captures


def find_chromium() -> str | None:
    """The first Chromium-like browser on PATH, or None."""
    for name in BINARIES:
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class PageCheck:
    """What loading one page showed."""

    console_errors: list[str] = field(default_factory=list)  # console.error, exceptions, failed loads
    images: list[dict[str, Any]] = field(default_factory=list)  # {src, ok, width, height}
    screenshot: bytes = b""
    text: str = ""  # what a reader sees: the page's rendered text

    @property
    def broken_images(self) -> list[str]:
        return [i["src"] for i in self.images if not i["ok"]]


class BrowserError(RuntimeError):
    """The browser did not start, answered an error, or missed a deadline."""


class Chromium:
    """One headless browser process, driven over the DevTools pipe. Use as a context manager."""

    def __init__(self, binary: str | None = None, timeout_s: float = 30.0):
        binary = binary or find_chromium()
        if binary is None:
            raise BrowserError(f"no Chromium on PATH; install it with: {INSTALL_HINT}")
        self.timeout_s = timeout_s
        self.profile = tempfile.TemporaryDirectory(prefix="meshlearn-chromium-")
        to_browser_r, self.to_browser = os.pipe()
        self.from_browser, from_browser_w = os.pipe()
        # High-numbered copies, so moving them onto fds 3 and 4 in the child cannot clobber either.
        child_r = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD_CLOEXEC, 10)
        child_w = fcntl.fcntl(from_browser_w, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(to_browser_r)
        os.close(from_browser_w)

        def fds_3_and_4() -> None:  # runs in the child before exec; dup2 makes them inheritable
            os.dup2(child_r, 3)
            os.dup2(child_w, 4)

        args = [binary, "--headless", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
                "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
                "--disable-extensions", "--disable-background-networking", "--hide-scrollbars",
                "--mute-audio", f"--user-data-dir={self.profile.name}", "about:blank"]
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 (open for the browser's lifetime)
        try:
            self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                            stderr=self.stderr, preexec_fn=fds_3_and_4, close_fds=False)
        finally:
            os.close(child_r)
            os.close(child_w)
        self.buffer = b""
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Ask the browser to quit, kill it if it does not, release the pipes and the profile."""
        if self.process.poll() is None:
            try:
                self._write({"id": self._id(), "method": "Browser.close"})
                self.process.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait(timeout=5)
        for fd in (self.to_browser, self.from_browser):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.stderr.close()
        self.profile.cleanup()

    # --- the protocol ------------------------------------------------------------------------

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _write(self, message: dict[str, Any]) -> None:
        os.write(self.to_browser, json.dumps(message).encode() + b"\0")

    def _read(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError(f"no answer from the browser within {self.timeout_s:g} s")
            ready, _, _ = select.select([self.from_browser], [], [], left)
            if ready:
                chunk = os.read(self.from_browser, 1 << 20)
                if not chunk:
                    self.stderr.seek(0)
                    tail = self.stderr.read()[-2000:].decode(errors="replace")
                    raise BrowserError(f"the browser exited (code {self.process.poll()}): {tail}")
                self.buffer += chunk
        raw, self.buffer = self.buffer.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method: str, params: dict[str, Any] | None = None,
             session: str | None = None) -> dict[str, Any]:
        """Send one command and wait for its reply; events that arrive meanwhile are kept."""
        message: dict[str, Any] = {"id": self._id(), "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        self._write(message)
        deadline = time.monotonic() + self.timeout_s
        while True:
            reply = self._read(deadline)
            if reply.get("id") == message["id"]:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error'].get('message')}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str, session: str) -> dict[str, Any]:
        """Wait for event ``method`` of ``session`` (it may already have arrived)."""
        deadline = time.monotonic() + self.timeout_s
        seen = 0
        while True:
            for event in self.events[seen:]:
                if event.get("method") == method and event.get("sessionId") == session:
                    return event
            seen = len(self.events)
            self.events.append(self._read(deadline))

    # --- one page ----------------------------------------------------------------------------

    def check_page(self, path: Path, width: int = WIDTH) -> PageCheck:
        """Load ``path`` (a local HTML file), wait for its load event, then report console errors,
        every image's state, the rendered text and a full-page PNG screenshot."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable", session=session)
        self.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": HEIGHT,
                                                         "deviceScaleFactor": 1, "mobile": False}, session)
        self.call("Page.navigate", {"url": Path(path).resolve().as_uri()}, session)
        self.wait_event("Page.loadEventFired", session)
        images = self.call("Runtime.evaluate", {"expression": _IMAGES_JS, "returnByValue": True},
                           session)["result"]["value"]
        text = self.call("Runtime.evaluate", {"expression": "document.body.innerText", "returnByValue": True},
                         session)["result"]["value"]
        metrics = self.call("Page.getLayoutMetrics", session=session)
        height = min(MAX_SCREENSHOT_HEIGHT, int(metrics["cssContentSize"]["height"]) + 1)
        self.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": height,
                                                         "deviceScaleFactor": 1, "mobile": False}, session)
        shot = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": False},
                         session)
        errors = [_describe(e) for e in self.events if e.get("sessionId") == session and _is_error(e)]
        self.call("Target.closeTarget", {"targetId": target})
        return PageCheck(errors, images, base64.b64decode(shot["data"]), text)


_IMAGES_JS = """[...document.images].map(i => ({src: i.getAttribute('src'),
  ok: i.complete && i.naturalWidth > 0, width: i.naturalWidth, height: i.naturalHeight}))"""


def _is_error(event: dict[str, Any]) -> bool:
    method, params = event.get("method"), event.get("params", {})
    if method == "Runtime.exceptionThrown":
        return True
    if method == "Runtime.consoleAPICalled":
        return params.get("type") in ("error", "assert")
    if method == "Log.entryAdded":
        return params.get("entry", {}).get("level") == "error"
    return False


def _describe(event: dict[str, Any]) -> str:
    params = event.get("params", {})
    if event["method"] == "Runtime.exceptionThrown":
        details = params.get("exceptionDetails", {})
        return f"exception: {details.get('text')} {details.get('exception', {}).get('description', '')}"
    if event["method"] == "Runtime.consoleAPICalled":
        return "console." + params.get("type", "?") + ": " + " ".join(
            str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
    entry = params.get("entry", {})
    return f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}".strip()


def main(argv: list[str] | None = None) -> int:
    """Check a report page and save its screenshot; exit 1 if it has errors or broken images."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python tests/report/browser.py INDEX.html SHOT.png", file=sys.stderr)
        return 2
    with Chromium() as browser:
        check = browser.check_page(Path(args[0]))
    Path(args[1]).write_bytes(check.screenshot)
    for problem in check.console_errors + [f"image did not load: {s}" for s in check.broken_images]:
        print(problem, file=sys.stderr)
    print(f"{args[1]}: {len(check.images)} images, {len(check.console_errors)} console errors")
    return 1 if check.console_errors or check.broken_images else 0


if __name__ == "__main__":
    raise SystemExit(main())
