"""The web console in a real browser: Debian's chromium driven by Playwright against real daemons
on loopback (a head with two workers; a daemon with API keys and an admin token). Each view is
saved as a screenshot (``SPECD_SCREENSHOTS``, else the test's temp directory) and checked with
axe-core's rules in the page."""

from __future__ import annotations

import json
import os
import shutil
import signal
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
from openai import OpenAI

from clusters import BUDGETS, joined
from conftest import model_manifest, start_daemon
from daemons import get, specd, wait_for

CHROMIUM = "/usr/bin/chromium"
BROWSER_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]
SECRET_KEY = "sk-console-key-4b1d"
ADMIN_SECRET = "admin-console-token-9f3e"


@contextmanager
def without_preload():
    """Playwright's driver (Node.js) and chromium inherit the environment: the OpenBLAS preload
    the tests run with breaks their threads, so they start without it."""
    preload = os.environ.pop("LD_PRELOAD", None)
    try:
        yield
    finally:
        if preload is not None:
            os.environ["LD_PRELOAD"] = preload


@pytest.fixture(scope="module")
def browser():
    if shutil.which(CHROMIUM) is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is required under CI (ops/test.sh installs it)")
        pytest.skip("Debian's chromium is not installed")
    from playwright.sync_api import sync_playwright
    with without_preload():
        playwright = sync_playwright().start()
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=BROWSER_FLAGS)
    try:
        yield chromium
    finally:
        chromium.close()
        playwright.stop()


@pytest.fixture()
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda err: errors.append(str(err)))
    # a refusal the page shows (401, 422) is logged by chromium as a failed load: not a page error
    page.on("console", lambda msg: errors.append(msg.text)
            if msg.type == "error" and not msg.text.startswith("Failed to load resource") else None)
    yield page
    context.close()
    assert errors == [], f"the page reported errors: {errors}"


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("SPECD_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def cluster(forged, tmp_path_factory):
    """A head (no room of its own) and workers w1 and w2 on loopback, Model m with a replica on each."""
    tmp = tmp_path_factory.mktemp("console-cluster")
    with joined(tmp) as (h, workers):
        (tmp / "m.yaml").write_text(model_manifest("m", forged / "target", replicas=2, **BUDGETS))
        specd(h, "apply", "-f", str(tmp / "m.yaml"))
        wait_for(lambda: get(h, "model", "m")["status"].get("readyReplicas") == 2, 120, "two replicas")
        yield h, workers


def accessible(page) -> None:
    """axe-core's WCAG rules pass on what the page shows now."""
    from axe_playwright_python.sync_playwright import Axe
    results = Axe().run(page)
    assert results.violations_count == 0, results.generate_report()


def open_view(page, url: str, tab: str) -> None:
    if not page.url.startswith(url):
        page.goto(url + "/ui/")
    page.get_by_role("tab", name=tab).click()
    page.get_by_role("heading", name=tab, level=2).wait_for()


def test_the_console_shows_each_node_its_memory_and_where_each_replica_runs(cluster, page, shots):
    h, _ = cluster
    response = page.goto(h.url + "/ui/")
    headers = response.headers
    assert "frame-ancestors 'none'" in headers["content-security-policy"]
    assert "script-src 'self'" in headers["content-security-policy"]
    assert headers["x-frame-options"] == "DENY" and headers["x-content-type-options"] == "nosniff"

    open_view(page, h.url, "Nodes")
    for name in ("head", "w1", "w2"):
        card = page.locator(f"[data-node={name}]")
        card.locator(".readiness", has_text="Ready").wait_for()
    for name in ("w1", "w2"):  # each worker's memory: its allocatable 2 GiB, and what m requests of it
        legend = page.locator(f"[data-node={name}] .legend.memory").inner_text()
        assert "allocatable 2.0 GiB" in legend and "requested" in legend, legend
        assert "m: Loaded" in page.locator(f"[data-node={name}] .node-models").inner_text()
        assert "Ready" in page.locator(f"[data-link={name}]").inner_text()
    page.screenshot(path=shots / "console-nodes.png", full_page=True)
    accessible(page)

    open_view(page, h.url, "Models")
    model = page.locator("[data-model=m]")
    model.locator(".phase", has_text="Ready").wait_for()
    assert sorted(model.locator("[data-replica]").all_inner_texts()) == ["w1 (Ready)", "w2 (Ready)"]
    page.screenshot(path=shots / "console-models.png", full_page=True)
    accessible(page)


def test_the_playground_streams_a_reply_token_by_token_and_shows_its_usage(cluster, page, shots):
    h, _ = cluster
    prompt = "def fibonacci(n):"
    open_view(page, h.url, "Playground")
    page.get_by_label("Temperature").fill("0")
    page.get_by_label("Max tokens").fill("24")
    page.get_by_label("Speculation").select_option("ngram")
    page.get_by_label("Draft tokens").fill("3")
    page.get_by_label("Message").fill(prompt)
    # every text the reply shows, as it changes
    page.evaluate("""() => { window.seen = [];
        new MutationObserver(() => { const t = document.querySelector('.turn.assistant .text');
          if (t && window.seen[window.seen.length - 1] !== t.textContent) window.seen.push(t.textContent); })
        .observe(document.querySelector('.transcript'), {subtree: true, childList: true, characterData: true}); }""")
    # a slow link (8 kB/s down, through chromium's own throttling) so the stream's events arrive
    # apart, as they do from a big model: a fast worker's whole reply can come in one read
    cdp = page.context.new_cdp_session(page)
    cdp.send("Network.enable")
    cdp.send("Network.emulateNetworkConditions", {"offline": False, "latency": 0, "downloadThroughput": 8000,
                                                   "uploadThroughput": -1})
    page.get_by_role("button", name="Send").click()
    page.locator(".usage .completion-tokens").wait_for(timeout=60_000)
    cdp.send("Network.emulateNetworkConditions", {"offline": False, "latency": 0, "downloadThroughput": -1,
                                                   "uploadThroughput": -1})
    seen = page.evaluate("window.seen")
    reply = page.locator(".turn.assistant .text").inner_text()
    assert len(seen) >= 3 and all(a != b and b.startswith(a) for a, b in zip(seen, seen[1:])), seen
    expected = OpenAI(base_url=h.url + "/v1", api_key="unused").chat.completions.create(
        model="m", messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=24)
    assert reply == expected.choices[0].message.content  # speculation is lossless: the API's greedy reply
    assert int(page.locator(".usage .completion-tokens").inner_text()) == expected.usage.completion_tokens
    assert int(page.locator(".usage .prompt-tokens").inner_text()) == expected.usage.prompt_tokens
    assert page.locator(".usage .speculation").inner_text().startswith("ngram (request)")
    page.screenshot(path=shots / "console-playground.png", full_page=True)
    accessible(page)

    # the tokens just generated on a worker show in m's live figures on the head
    open_view(page, h.url, "Models")
    rate = page.locator("[data-model=m] [data-figure='tokens/s'] .value")
    wait_for(lambda: rate.inner_text() not in ("–", "0.0"), 20, "tokens/s from the workers' counters")
    page.screenshot(path=shots / "console-models-figures.png", full_page=True)


def test_every_control_is_reachable_by_keyboard(cluster, page):
    h, _ = cluster
    open_view(page, h.url, "Playground")
    controls = page.evaluate("""() => [...document.querySelectorAll('button, input, select, textarea, summary')]
        .filter((e) => !e.disabled && e.offsetParent !== null).length""")
    page.locator("body").focus()
    reached = set()
    for _ in range(controls + 5):
        page.keyboard.press("Tab")
        reached.add(page.evaluate("""() => { const e = document.activeElement;
            const name = e.id || e.getAttribute('aria-label') || e.labels?.[0]?.textContent || e.textContent;
            return e.tagName + ':' + name.trim(); }"""))
    focusable = {r for r in reached if not r.startswith("BODY")}
    assert len(focusable) >= controls, (controls, sorted(focusable))


def test_apply_shows_the_field_path_stores_nothing_then_applies(cluster, forged, page, shots):
    h, _ = cluster
    open_view(page, h.url, "Apply")
    bad = model_manifest("broken", forged / "target", kvCache="{maxBytes: lots}")
    page.get_by_label("Manifests (YAML)").fill(bad)
    page.get_by_role("button", name="Apply", exact=True).click()
    assert page.locator(".apply-error .field-path").inner_text() == "items[0].spec.kvCache.maxBytes"
    assert h.get("/apis/specd.dev/v1alpha1/models/broken")[0] == 404
    page.screenshot(path=shots / "console-apply-refused.png", full_page=True)

    good = model_manifest("idle", forged / "target", scaling="{minReplicas: 0}")
    page.get_by_label("Manifests (YAML)").fill(good)
    page.get_by_role("button", name="Dry run and diff").click()
    page.locator(".apply-result", has_text="Dry run").wait_for()
    assert page.locator(".apply-result .action").inner_text() == "created"
    diff = page.locator(".apply-result pre.diff").inner_text()
    assert "+metadata:\n+  name: idle\n" in diff, diff  # line by line
    assert page.locator(".apply-result .error").count() == 0  # it fits a worker: no warning
    assert h.get("/apis/specd.dev/v1alpha1/models/idle")[0] == 404  # a dry run stores nothing
    page.screenshot(path=shots / "console-apply-diff.png", full_page=True)
    accessible(page)
    page.get_by_role("button", name="Apply", exact=True).click()
    page.locator(".apply-result h3", has_text="Applied").wait_for()
    open_view(page, h.url, "Models")
    page.locator("[data-model=idle]").wait_for()
    assert h.get("/apis/specd.dev/v1alpha1/models/idle")[0] == 200


def test_a_frozen_node_turns_not_ready_on_the_page(cluster, page, shots):
    h, workers = cluster
    open_view(page, h.url, "Nodes")
    page.locator("[data-node=w2] .readiness", has_text="Ready").wait_for()
    workers["w2"].proc.send_signal(signal.SIGSTOP)
    try:
        page.locator("[data-node=w2] .readiness", has_text="NotReady").wait_for(timeout=30_000)
        assert "NotReady" in page.locator("[data-link=w2]").inner_text()
        assert page.locator("[data-node=w1] .readiness").inner_text() == "Ready"
        page.screenshot(path=shots / "console-node-not-ready.png", full_page=True)
    finally:
        workers["w2"].proc.send_signal(signal.SIGCONT)
    page.locator("[data-node=w2] .readiness", has_text="Ready").wait_for(timeout=30_000)


@pytest.fixture(scope="module")
def keyed(forged, tmp_path_factory):
    """A daemon with API keys and an admin token, serving a vision-language Model (a tiny Gemma 3)."""
    from specd.forge.vision import build
    tmp = tmp_path_factory.mktemp("console-keys")
    (tmp / "keys").write_text(SECRET_KEY + "\n")
    eyes = build("gemma3", tmp / "gemma3", forged / "target", seed=3)
    daemon = start_daemon(tmp, {"eyes.yaml": model_manifest("eyes", eyes)}, True, "--api-key-file", str(tmp / "keys"),
                          admin_token=ADMIN_SECRET)
    yield daemon
    daemon.stop(signal.SIGKILL)


def enter_key(page, daemon) -> None:
    page.goto(daemon.url + "/ui/")
    page.get_by_label("API key").fill(SECRET_KEY)
    page.get_by_role("button", name="Open the console").click()
    page.get_by_role("tab", name="Nodes").wait_for()


def test_with_api_keys_the_console_shows_nothing_but_the_key_prompt(keyed, forged, page, shots):
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(keyed.url + "/ui/api/overview", timeout=10)
    assert refused.value.code == 401

    page.goto(keyed.url + "/ui/")
    page.get_by_label("API key").wait_for()
    assert page.locator("header").count() == 0 and page.get_by_role("tab").count() == 0
    assert page.locator("[data-node]").count() == 0
    page.screenshot(path=shots / "console-key-prompt.png", full_page=True)
    accessible(page)

    page.get_by_label("API key").fill("sk-wrong")
    page.get_by_role("button", name="Open the console").click()
    page.get_by_role("alert").filter(has_text="refused").wait_for()
    assert page.get_by_role("tab").count() == 0

    enter_key(page, keyed)
    assert SECRET_KEY not in page.content() and page.locator("[data-node]").count() == 1

    # applying needs the admin API's token: asked for when the admin API refuses, never shown
    open_view(page, keyed.url, "Apply")
    page.get_by_label("Manifests (YAML)").fill(model_manifest("later", forged / "target", scaling="{minReplicas: 0}"))
    page.get_by_role("button", name="Apply", exact=True).click()
    page.get_by_label("Admin token").fill(ADMIN_SECRET)
    page.get_by_role("button", name="Use this token").click()
    page.get_by_role("button", name="Apply", exact=True).click()
    page.locator(".apply-result h3", has_text="Applied").wait_for()
    assert ADMIN_SECRET not in page.content() and SECRET_KEY not in page.content()
    assert json.loads(keyed.get("/apis/specd.dev/v1alpha1/models/later")[1])["metadata"]["name"] == "later"


def test_the_playground_attaches_an_image_where_the_model_takes_images(keyed, page, shots, tmp_path):
    from PIL import Image
    Image.new("RGB", (64, 48), (200, 40, 40)).save(tmp_path / "red.png")
    enter_key(page, keyed)
    open_view(page, keyed.url, "Playground")
    page.get_by_label("Model").select_option("eyes")
    page.get_by_label("Temperature").fill("0")
    page.get_by_label("Max tokens").fill("8")
    page.get_by_label("Image").set_input_files(tmp_path / "red.png")
    page.get_by_label("Message").fill("What colour is this?")
    page.get_by_role("button", name="Send").click()
    page.locator(".usage .prompt-tokens").wait_for(timeout=60_000)
    assert page.get_by_role("img", name="attached image").count() == 1
    with_image = int(page.locator(".usage .prompt-tokens").inner_text())
    page.screenshot(path=shots / "console-playground-image.png", full_page=True)
    accessible(page)
    page.get_by_role("button", name="New chat").click()
    page.get_by_label("Message").fill("What colour is this?")
    page.get_by_role("button", name="Send").click()
    page.locator(".usage .prompt-tokens").wait_for(timeout=60_000)
    assert with_image > int(page.locator(".usage .prompt-tokens").inner_text())  # the image's tokens
