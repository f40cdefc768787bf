"""The desktop example (examples/desktop/app.py) on a virtual X display: load a package, stream a
completion, stop it mid-way, and show bad input in the window instead of raising. Drives the app
in-process through its buttons and pumps Tk's event loop by hand, as mainloop() would."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

APP = Path(__file__).resolve().parent.parent / "examples" / "desktop" / "app.py"
STEP_DELAY_S = 0.02  # see SlowSession below

tkinter = pytest.importorskip("tkinter", reason="tkinter is not installed (Debian: apt-get install python3-tk)")
pytestmark = pytest.mark.skipif(
    not (shutil.which("Xvfb") and shutil.which("import") and shutil.which("identify")),
    reason="needs Xvfb and ImageMagick's import/identify (Debian: apt-get install xvfb imagemagick)",
)


@pytest.fixture(scope="module")
def display(tmp_path_factory) -> Iterator[str]:
    """A private Xvfb server. -displayfd makes Xvfb pick a free display number itself and write it
    to the pipe once it accepts connections, so there is neither a guessed number nor a sleep."""
    log = tmp_path_factory.mktemp("xvfb") / "xvfb.log"  # a file, not a pipe nobody reads that could fill up
    read_end, write_end = os.pipe()
    with open(log, "wb") as log_file:
        server = subprocess.Popen(
            ["Xvfb", "-displayfd", str(write_end), "-screen", "0", "1024x768x24", "-nolisten", "tcp"],
            pass_fds=(write_end,),
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    os.close(write_end)
    try:
        with os.fdopen(read_end) as pipe:
            number = pipe.readline().strip()  # empty if Xvfb exited
        if not number:
            server.wait(timeout=5)
            pytest.fail(f"Xvfb did not start: {log.read_text(errors='replace')[-500:]}")
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("DISPLAY", f":{number}")
            yield f":{number}"
    finally:
        server.terminate()
        try:
            server.wait(timeout=5)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.fixture
def app(display):
    spec = importlib.util.spec_from_file_location("desktop_app", APP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    root = tkinter.Tk()
    root.geometry("800x500+0+0")
    # Tk prints exceptions raised in callbacks and carries on; collect them so the test can fail on one
    root.callback_errors = []
    root.report_callback_exception = lambda *exc: root.callback_errors.append(exc)
    app = module.CompletionApp(root, provider="cpu", threads=1)
    yield app
    app.stop_generation()
    pump(root, lambda: not app.is_busy, timeout=10)
    root.destroy()
    assert not root.callback_errors, f"a Tk callback raised: {root.callback_errors[0][1]!r}"


def pump(root, condition: Callable[[], bool], *, timeout: float) -> bool:
    """Run Tk's event loop until condition() holds; False if timeout seconds pass first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        root.update()
        time.sleep(0.005)
    return True


class SlowSession:
    """The tiny model decodes 50 tokens in a few ms, before any Stop could land; an ONNX Runtime
    session that waits STEP_DELAY_S per step gives generation a human pace. Everything else passes through."""

    def __init__(self, session):
        self._session = session

    def __getattr__(self, name):
        return getattr(self._session, name)

    def run_with_iobinding(self, *args, **kwargs):
        time.sleep(STEP_DELAY_S)
        return self._session.run_with_iobinding(*args, **kwargs)


def load_tiny(app, package: Path) -> None:
    app.package_path.set(str(package))
    app.load_button.invoke()
    assert app.is_busy, "loading should run on the worker thread"
    assert pump(app.root, lambda: not app.is_busy, timeout=60), "loading did not finish"
    assert app.model is not None, app.status_text
    assert app.status_text.startswith("Loaded"), app.status_text


def set_prompt(app, text: str, **params: str) -> None:
    app.prompt.delete("1.0", "end")
    app.prompt.insert("1.0", text)
    for key, value in params.items():
        app.params[key].set(value)


def test_generate_stop_and_screenshot(app, package, tmp_path):
    load_tiny(app, package)
    app.model.session = SlowSession(app.model.session)
    # 50 of the 64 positions, a high temperature and a seed with which the random model does not hit EOS in 50 tokens
    set_prompt(app, "ROMEO:", max_new_tokens="50", temperature="1.5", top_k="0", top_p="1.0", seed="1")
    app.generate_button.invoke()
    assert app.is_generating and str(app.stop_button["state"]) == "normal"
    assert str(app.generate_button["state"]) == "disabled", "a second Generate while one runs must be impossible"

    # the UI thread stays responsive: pumping returns promptly while the worker generates
    assert pump(app.root, lambda: len(app.output_text()) >= 3, timeout=30), f"no text appeared: {app.status_text}"
    assert app.is_generating, f"generation ended before Stop: {app.status_text}"
    stopped_at = time.monotonic()
    app.stop_button.invoke()
    assert pump(app.root, lambda: not app.is_generating, timeout=5), "Stop did not end generation"
    elapsed = time.monotonic() - stopped_at
    result = app.last_result
    assert result.finish_reason == "cancelled", f"finish reason {result.finish_reason!r} after Stop"
    assert 0 < result.timings.new_tokens < 50
    # cancel is checked before every step: a Stop costs at most the step in flight plus one poll
    assert elapsed < 1.0, f"Stop took {elapsed:.2f} s"
    assert "tokens/s" in app.status_text and "cancelled" in app.status_text, app.status_text
    assert app.output_text() == result.text
    assert str(app.generate_button["state"]) == "normal"

    screenshot = tmp_path / "desktop.png"
    pump(app.root, lambda: False, timeout=0.2)  # let Tk draw the final state
    subprocess.run(["import", "-window", "root", str(screenshot)], check=True, timeout=30)
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert screenshot.stat().st_size > 5_000, "the screenshot is nearly empty"
    described = subprocess.run(
        ["identify", "-format", "%w %h %k", str(screenshot)], capture_output=True, text=True, check=True, timeout=30
    ).stdout.split()
    width, height, colours = map(int, described)
    assert (width, height) == (1024, 768)
    assert colours > 20, f"the screenshot has only {colours} colours: the window was not drawn"


def test_errors_show_in_the_window(app, package):
    app.package_path.set(str(package.parent / "no-such-package"))
    app.load_button.invoke()
    assert pump(app.root, lambda: not app.is_busy, timeout=30)
    assert app.status_text.startswith("Error:") and "no-such-package" in app.status_text, app.status_text
    assert app.model is None

    app.generate_button.invoke()
    assert app.status_text.startswith("Error: Load a model package first"), app.status_text

    load_tiny(app, package)
    for key, value, expected in [
        ("temperature", "-1", "temperature"),
        ("top_k", "many", "Top-k"),
        ("top_p", "0", "top_p"),
        ("max_new_tokens", "500", "context length"),
    ]:
        set_prompt(app, "ROMEO:", max_new_tokens="10", temperature="0.8", top_k="40", top_p="1.0", seed="")
        app.params[key].set(value)
        app.generate_button.invoke()
        assert not app.is_generating, f"{key}={value} should not start a generation"
        assert app.status_text.startswith("Error:") and expected in app.status_text, app.status_text

    # after the errors the app still works, and a failed load keeps the loaded model
    app.package_path.set("/nonexistent/edgelm-package")
    app.load_button.invoke()
    assert pump(app.root, lambda: not app.is_busy, timeout=30)
    assert app.status_text.startswith("Error:") and app.model is not None
    set_prompt(app, "ROMEO:", max_new_tokens="5", temperature="0", top_k="0", top_p="1.0", seed="")
    app.generate_button.invoke()
    assert pump(app.root, lambda: not app.is_generating, timeout=30)
    assert app.last_result.finish_reason in ("length", "eos"), app.status_text
    assert app.output_text() == app.last_result.text
