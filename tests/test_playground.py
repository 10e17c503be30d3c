"""The playground page (``GET /``) in a real headless Chromium against a real server on the tiny
model, plus the server side it relies on: ``exit_tokens`` in stream chunks, the exit-config
route, ``--no-ui``. Browser tests skip, saying why, where Chromium, chromedriver or selenium is
missing (``make test`` installs them on Debian).
"""

from __future__ import annotations

import json
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from eeserve.server.formatting import token_piece
from eeserve.tuning.quality import rouge_l
from tests.live_server import Server

API_KEY = "ui-key"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROME_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    # Without these Chromium's own connections are refused on a closed network and it stalls.
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,900",
]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[Server]:
    srv = Server(tiny_model_dir, "--api-key", API_KEY)
    yield srv
    assert srv.stop(signal.SIGINT) == 0, srv.output()


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.base, headers=headers, timeout=60) as c:
        yield c


def _chat(server: Server, early_exit: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "model": server.model,
        "messages": [{"role": "user", "content": "Say something"}],
        "max_tokens": 12,
        "temperature": 0,
        "early_exit": early_exit,
        **extra,
    }


def _events(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


# -- the server side ---------------------------------------------------------------------------


@pytest.mark.slow
def test_stream_carries_exit_tokens(server: Server, http: httpx.Client) -> None:
    body = _chat(server, {"threshold": 0.0, "measure": "softmax_margin"}, ignore_eos=True)
    choices = [c for ev in _events(http, body) for c in ev["choices"]]
    entries = [e for c in choices for e in c.get("exit_tokens", [])]
    content = "".join(c["delta"].get("content", "") for c in choices)
    assert len(entries) == 12
    assert "".join(e["text"] for e in entries) == content
    # The first token comes from the prefill (full depth); threshold 0 exits the rest at layer 1.
    assert entries[0]["exit_layer"] == 4 and entries[0]["confidence"] is None
    assert all(e["exit_layer"] == 1 and isinstance(e["confidence"], float) for e in entries[1:])

    full = [c for ev in _events(http, _chat(server, {"enabled": False})) for c in ev["choices"]]
    layers = {e["exit_layer"] for c in full for e in c.get("exit_tokens", [])}
    assert layers == {4}


def test_token_pieces_concatenate_to_the_text(tiny_model_dir: Path) -> None:
    """Pieces add up to the output text, also through split and invalid UTF-8 (random ids)."""
    import random

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rng = random.Random(0)
    cases = [list(tok("Héllo wörld, naïve café 日本語 😀 done.  Two  spaces\n").input_ids)]
    cases += [[rng.randrange(len(tok)) for _ in range(30)] for _ in range(20)]
    for ids in cases:
        for finished in (True, False):
            anchor, pieces = 0, []
            for k in range(len(ids)):
                last = finished and k == len(ids) - 1
                done = sum(map(len, pieces))
                piece, complete = token_piece(tok, ids, k, anchor, done, last=last)
                pieces.append(piece)
                anchor = k + 1 if complete else anchor
            text = tok.decode(ids, skip_special_tokens=True)
            assert "".join(pieces) == (text if finished else text.rstrip("\ufffd"))


@pytest.mark.slow
def test_exit_config_route_and_auth(server: Server, http: httpx.Client) -> None:
    cfg = http.get("/v1/eeserve/exit_config").json()
    assert cfg["num_layers"] == 4 and cfg["exit_layers"] == [1, 2, 3]
    assert cfg["default_measure"] in cfg["measures"] and cfg["exit_policy"] == "auto"
    assert httpx.get(f"{server.base}/v1/eeserve/exit_config").status_code == 401
    # The page and its files need no key (they hold none); the API behind them does.
    page = httpx.get(f"{server.base}/")
    assert page.status_code == 200 and "eeserve playground" in page.text
    js = httpx.get(f"{server.base}/ui/playground.js")
    assert js.status_code == 200 and "javascript" in js.headers["content-type"]
    assert httpx.get(f"{server.base}/ui/nothing.js").status_code == 404


@pytest.mark.slow
@pytest.mark.parametrize("threshold", [5, -1.5, [0.5, 2, 0.5]])
def test_threshold_outside_measure_range_is_400(
    server: Server, http: httpx.Client, threshold: Any
) -> None:
    r = http.post("/v1/chat/completions", json=_chat(server, {"threshold": threshold}))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "early_exit.threshold" and "[-1, 1]" in err["message"]


@pytest.mark.slow
def test_no_ui_flag(tiny_model_dir: Path) -> None:
    srv = Server(tiny_model_dir, "--no-ui")
    try:
        assert httpx.get(f"{srv.base}/").status_code == 404
        assert httpx.get(f"{srv.base}/ui/playground.js").status_code == 404
        assert httpx.get(f"{srv.base}/v1/eeserve/exit_config").status_code == 200
    finally:
        assert srv.stop() == 0, srv.output()


# -- in a browser --------------------------------------------------------------------------------


def _browser_missing() -> str | None:
    for path in (CHROMIUM, CHROMEDRIVER):
        if not Path(path).exists():
            return f"{path} missing (apt-get install -y chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium not installed (pip install -e '.[dev]')"
    return None


browser = pytest.mark.skipif(_browser_missing() is not None, reason=str(_browser_missing()))


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="eeserve-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*CHROME_FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    d = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    d.set_script_timeout(30)
    yield d
    d.quit()
    shutil.rmtree(profile, ignore_errors=True)


class Page:
    """The playground in the browser, driven the way a person would (typing, keys, clicks)."""

    def __init__(self, driver: Any, base: str, key: str | None = API_KEY) -> None:
        from selenium.webdriver.common.by import By
        from selenium.webdriver.common.keys import Keys
        from selenium.webdriver.support.ui import WebDriverWait

        self.d, self.By, self.Keys = driver, By, Keys
        self.wait = WebDriverWait(driver, 60)
        driver.get(base + "/")
        if key:
            self.el("api-key").send_keys(key, Keys.TAB)  # change event: loads model + config
            self.wait.until(lambda _: self.css("#legend span"))

    def el(self, id_: str) -> Any:
        return self.d.find_element(self.By.ID, id_)

    def css(self, selector: str) -> list[Any]:
        return list(self.d.find_elements(self.By.CSS_SELECTOR, selector))

    def set_value(self, id_: str, value: str) -> None:
        field = self.el(id_)
        field.clear()
        field.send_keys(value)

    def exits(self, *, enabled: bool, value: str = "", measure: str = "softmax_margin") -> None:
        box = self.el("ee-enabled")
        if box.is_selected() != enabled:
            box.click()
        from selenium.webdriver.support.ui import Select

        Select(self.el("ee-measure")).select_by_value(measure)
        self.set_value("ee-value", value)

    def send(self, prompt: str, *, ctrl: bool = False) -> None:
        answers = len(self.css(".msg.assistant .stats"))
        box = self.el("prompt")
        box.send_keys(prompt)
        if ctrl:
            box.send_keys(self.Keys.CONTROL, self.Keys.ENTER)
        else:
            box.send_keys(self.Keys.ENTER)
        self.wait.until(lambda _: len(self.css(".msg.assistant .stats")) > answers or self.error())

    def error(self) -> str:
        e = self.el("error")
        return "" if e.get_attribute("hidden") is not None else str(e.text)

    def last_request(self) -> dict[str, Any]:
        text = self.d.execute_script("return document.getElementById('last-request').textContent")
        return dict(json.loads(text))


@pytest.mark.slow
@browser
def test_chat_colours_tokens_by_exit_layer(server: Server, driver: Any) -> None:
    page = Page(driver, server.base)
    page.set_value("max-tokens", "10")
    page.exits(enabled=True, value="0")
    page.send("Hello there")
    assert page.error() == ""
    body = page.last_request()
    assert body["early_exit"] == {"enabled": True, "measure": "softmax_margin", "threshold": 0}
    assert body["stream"] is True and body["max_tokens"] == 10
    tokens = page.css(".msg.assistant .tok")
    layers = [int(t.get_attribute("data-layer")) for t in tokens]
    assert layers and min(layers) == 1  # threshold 0: decode tokens leave at the first exit
    exited = [t for t in tokens if t.get_attribute("data-layer") == "1"]
    legend = page.css('#legend span[data-layer="1"]')[0]
    assert exited[0].value_of_css_property("background-color") == legend.value_of_css_property(
        "background-color"
    )
    full = [t for t in tokens if t.get_attribute("data-layer") == "4"]
    for t in full:  # full depth stays plain
        assert t.value_of_css_property("background-color") in ("rgba(0, 0, 0, 0)", "transparent")

    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(driver).move_to_element(exited[0]).perform()
    tip = page.el("tooltip")
    page.wait.until(lambda _: tip.is_displayed())
    assert "exit layer 1 of 4" in tip.text and "confidence" in tip.text

    # Changing the threshold changes the next request's body (Ctrl+Enter sends too).
    page.set_value("ee-value", "0.25")
    page.send("Again", ctrl=True)
    assert page.last_request()["early_exit"]["threshold"] == 0.25
    assert len(page.css(".msg.assistant")) == 2


@pytest.mark.slow
@browser
@pytest.mark.parametrize(("value", "fragment"), [("5", "[-1, 1]"), ("abc", "valid number")])
def test_bad_threshold_shows_server_error(
    server: Server, http: httpx.Client, driver: Any, value: str, fragment: str
) -> None:
    page = Page(driver, server.base)
    page.exits(enabled=True, value=value)
    page.send("Hi")
    body = page.last_request()
    expected = http.post("/v1/chat/completions", json=body).json()["error"]["message"]
    assert fragment in expected
    assert page.error() == expected
    assert not page.css(".msg")  # the failed exchange leaves no half message
    assert page.el("prompt").get_attribute("value") == "Hi"


@pytest.mark.slow
@browser
def test_without_the_key_the_page_says_so(server: Server, driver: Any) -> None:
    page = Page(driver, server.base, key=None)
    page.wait.until(lambda _: page.error())
    assert "API key" in page.error()
    page.el("prompt").send_keys("Hi", page.Keys.ENTER)
    assert "API key" in page.error() and not page.css(".msg")


@pytest.mark.slow
@browser
def test_full_depth_comparison_and_metrics(server: Server, driver: Any) -> None:
    page = Page(driver, server.base)
    page.set_value("max-tokens", "12")
    page.exits(enabled=True, value="0")
    page.send("Compare me")
    page.el("compare").click()
    page.wait.until(lambda _: page.css("#comparison-summary[data-rouge-l]"))
    assert page.last_request()["early_exit"] == {"enabled": False}
    early, full = (e.text for e in page.css("#comparison .side .body"))
    summary = page.el("comparison-summary")
    assert float(summary.get_attribute("data-rouge-l")) == pytest.approx(
        rouge_l(early, full), abs=1e-4
    )
    speeds = [s.text for s in page.css("#comparison .speed")]
    assert all("tokens/s" in s for s in speeds) and len(speeds) == 2
    right = page.css("#comparison .side:nth-child(2) .tok")
    full_layers = {t.get_attribute("data-layer") for t in right}
    assert full_layers == {"4"}

    # The page's ROUGE-L is the Python definition (whitespace words, F1 of the LCS).
    pairs = [("a b c d", "a c d e"), ("the cat  sat\n", "the  cat"), ("", ""), ("x", "")]
    got = driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "import('/ui/compare.js').then(m => done(arguments[0].map(p => m.rougeL(p[0], p[1]))));",
        [list(p) for p in pairs],
    )
    assert got == pytest.approx([rouge_l(a, b) for a, b in pairs])

    # The metrics panel reads /metrics: tokens generated so far and the exit-layer histogram.
    page.wait.until(lambda _: page.css('#histogram .bar[data-layer="1"]'))
    generated = page.css('dd[data-metric="tokens generated"]')[0]
    assert float(generated.text) > 0
    assert page.css('dd[data-metric="layers saved"]')[0].text.endswith("%")


@pytest.mark.slow
@browser
def test_phone_width(server: Server, driver: Any) -> None:
    driver.set_window_size(390, 844)
    try:
        page = Page(driver, server.base)
        overflow = driver.execute_script(
            "return document.documentElement.scrollWidth - window.innerWidth"
        )
        assert overflow <= 0
        labels = driver.execute_script(
            "return [...document.querySelectorAll('input, select, textarea')]"
            ".filter(e => !e.labels || !e.labels.length).map(e => e.id)"
        )
        assert labels == []
        assert page.el("send").is_displayed()
    finally:
        driver.set_window_size(1280, 900)


@pytest.mark.slow
@browser
def test_hover_shows_speculative_fields_when_present(server: Server, driver: Any) -> None:
    """A `draft` object (speculative decoding) in an entry is shown; without it nothing breaks."""
    Page(driver, server.base)
    drafted = {"text": "x", "exit_layer": 10, "confidence": 0.91234, "draft": {"accepted": False}}
    plain = {"text": "y", "exit_layer": 30, "confidence": None}
    info = driver.execute_async_script(
        "const [a, b, done] = arguments;"
        "import('/ui/render.js').then(m => done([m.tokenInfo(a, 30), m.tokenInfo(b, 30)]));",
        drafted,
        plain,
    )
    lines = info[0].split("\n")
    assert lines == ["exit layer 10 of 30", "confidence 0.912", "draft accepted: false"]
    assert info[1] == "full depth (layer 30)"


@pytest.mark.slow
@browser
def test_a_json_schema_shapes_the_answer(server: Server, driver: Any) -> None:
    """The schema box sends ``response_format``; the answer parses and follows the schema, and
    the tokens the grammar forced are coloured as the legend's forced entry."""
    import jsonschema

    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99}},
        "required": ["ok", "n"],
    }
    page = Page(driver, server.base)
    page.set_value("max-tokens", "60")
    page.exits(enabled=True, value="0")
    page.set_value("json-schema", json.dumps(schema))
    page.send("Give me JSON")
    assert page.error() == ""
    fmt = page.last_request()["response_format"]
    assert fmt == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema, "strict": True},
    }
    tokens = page.css(".msg.assistant .tok")
    jsonschema.validate(json.loads("".join(t.text for t in tokens)), schema)
    forced = [t for t in tokens if t.get_attribute("data-forced") == "true"]
    legend = page.css("#legend span.forced")[0]
    assert forced and all(
        t.value_of_css_property("background-color")
        == legend.value_of_css_property("background-color")
        for t in forced
    )
    page.set_value("json-schema", '{"type": "objekt"}')
    page.send("Again")
    assert "response_format.json_schema.schema" in page.error()
