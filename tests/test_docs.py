"""The documentation site builds in strict mode, shows exactly the public surface, and works in a browser.

The site (mkdocs.yml, docs/, tools/docs_site.py) is built once for this module
with `mkdocs build --strict`, in a subprocess, as a user builds it. Then:

- the API reference it rendered holds every public name and nothing else (the
  list: `keras_distrib._PUBLIC` and the public modules' `__all__`);
- strict mode fails on what it is for (a broken link, a missing anchor, a
  docstring naming an argument the function lacks), on a small site of the
  same settings;
- headless Chromium (Debian's, driven by Playwright; `tools/setup_browser.sh`
  installs it) opens the home page, a guide, an API page and a tutorial with
  its plot: each renders, every internal link on them resolves (anchors
  included), the console shows no error, and the search finds a public
  function by name. A screenshot of each is kept in test-artifacts/docs/.
"""

import functools
import html.parser
import http.server
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.parse

import pytest

import keras_distrib as kd

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARTIFACTS = os.path.join(REPO, "test-artifacts", "docs")
CHROMIUM = "/usr/bin/chromium"
# The pages the browser opens: (name, path in the site).
PAGES = (
    ("home", ""),
    ("guide", "guides/own-train-step/"),
    ("api", "reference/data/"),
    ("tutorial", "tutorials/own_train_step/"),
)
SEARCHED = "distribute_dataset"  # a public function, found by name


def _build(config, site_dir, cwd, timeout=240):
    """`mkdocs build --strict` in a fresh process; returns (exit code, output, seconds)."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": REPO}
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", config, "-d", site_dir],
        cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(f"mkdocs build ran past {timeout} s:\n{output[-3000:]}") from None
    return process.returncode, output, time.monotonic() - started


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    site_dir = str(tmp_path_factory.mktemp("site"))
    code, output, seconds = _build(os.path.join(REPO, "mkdocs.yml"), site_dir, REPO)
    assert code == 0, f"the strict build failed:\n{output[-6000:]}"
    print(f"site built in {seconds:.1f} s")
    return site_dir


# The rendered reference against the public surface.


def _ids(path):
    with open(path, encoding="utf-8") as f:
        return set(re.findall(r'\bid="(keras_distrib[.\w]*)"', f.read()))


def expected_reference():
    """{page: the identifiers of the public objects it must render, and no others}."""
    pages = {"kd": {f"keras_distrib.{name}" for name, (_, attribute) in kd._PUBLIC.items()
                    if attribute is not None}}
    for name, (module, attribute) in kd._PUBLIC.items():
        if attribute is None:
            pages[name] = {f"{module}.{member}" for member in getattr(kd, name).__all__}
    return pages


def reference_problems(expected, rendered):
    """Differences between the public names (`expected`) and what each page rendered.

    `rendered`: {page: every `keras_distrib...` id on it}. Members of a class
    (`keras_distrib.TrainLoop.fit`) are the class's own business and not counted.
    """
    problems = []
    for page, names in sorted(expected.items()):
        depth = 2 if page == "kd" else names and len(next(iter(names)).split("."))
        shown = {i for i in rendered.get(page, ()) if len(i.split(".")) == depth}
        problems += [f"reference/{page}: {n} is public but not shown" for n in sorted(names - shown)]
        problems += [f"reference/{page}: {n} is shown but not public" for n in sorted(shown - names)]
    problems += [f"reference/{page}: a page for no public module" for page in sorted(set(rendered) - set(expected))]
    return problems


@pytest.mark.cluster
@pytest.mark.xdist_group("docs")
def test_the_reference_shows_every_public_name_and_nothing_else(site):
    rendered = {}
    for page in os.listdir(os.path.join(site, "reference")):
        path = os.path.join(site, "reference", page, "index.html")
        if os.path.isfile(path) and _ids(path):
            rendered[page] = _ids(path)
    expected = expected_reference()
    assert len(expected["kd"]) >= 20 and len(expected) >= 8
    assert reference_problems(expected, rendered) == []
    # The contrast: a made-up public name, and a shown name nobody exports.
    expected["data"].add("keras_distrib.data.made_up")
    rendered["losses"] = rendered["losses"] | {"keras_distrib.losses.fit_epochs"}
    assert reference_problems(expected, rendered) == [
        "reference/data: keras_distrib.data.made_up is public but not shown",
        "reference/losses: keras_distrib.losses.fit_epochs is shown but not public",
    ]


def example_problems(html):
    """Docstring examples (`>>>` lines) on a rendered page that are not shown as code:
    left as text, or read by Markdown as three nested quotes."""
    outside = re.sub(r"<pre[^>]*>.*?</pre>", "", html, flags=re.S)
    quoted = re.findall(r"<blockquote>\s*<blockquote>\s*<blockquote>\s*<p>([^<]{0,80})", outside)
    return [line.strip()[:80] for line in outside.splitlines() if "&gt;&gt;&gt;" in line] + quoted


@pytest.mark.cluster
@pytest.mark.xdist_group("docs")
def test_docstring_examples_render_as_code(site):
    shown, problems = 0, []
    for page in sorted(os.listdir(os.path.join(site, "reference"))):
        path = os.path.join(site, "reference", page, "index.html")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                html = f.read()
            shown += len(re.findall(r"<pre[^>]*>(?:(?!</pre>).)*&gt;&gt;&gt;", html, flags=re.S))
            problems += [f"reference/{page}: {line}" for line in example_problems(html)]
    assert problems == []
    assert shown >= 20, shown
    # The contrast: an `Example:` section (not a Google-style section name) is
    # prose, and Markdown reads its `>>>` as quotes (kd.make_strategy's, before).
    assert example_problems('<details class="example" open>\n<summary>Example</summary>\n<blockquote>\n'
                            '<blockquote>\n<blockquote>\n<p>import keras_distrib as kd\n')


@pytest.mark.cluster
@pytest.mark.xdist_group("docs")
def test_every_tutorial_is_a_page_with_its_figures(site):
    for notebook in sorted(os.listdir(os.path.join(REPO, "tutorials"))):
        if not notebook.endswith(".ipynb"):
            continue
        name = notebook[:-6]
        page = os.path.join(site, "tutorials", name, "index.html")
        assert os.path.isfile(page), name
        assert os.path.isfile(os.path.join(site, "tutorials", notebook)), f"{notebook} to download"
        with open(os.path.join(REPO, "tutorials", notebook)) as f:
            figures = f.read().count('"image/png"')
        with open(page, encoding="utf-8") as f:
            shown = len(re.findall(r'<img [^>]*src="[^"]*_files/cell\d+_\d+\.png"', f.read()))
        assert shown == figures, (name, shown, figures)


@pytest.mark.cluster
@pytest.mark.xdist_group("docs")
def test_strict_mode_fails_on_a_broken_link_a_missing_anchor_and_a_stale_docstring(tmp_path):
    # A small site with the real site's settings (strict, validation, mkdocstrings'
    # options): each of the three faults is reported, and the build fails.
    import yaml

    with open(os.path.join(REPO, "mkdocs.yml")) as f:
        real = yaml.safe_load(f)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text(
        "# Home\n\n[a page that is not there](missing.md), [an anchor that is not there](#nowhere)\n\n"
        "::: stale_module.f\n")
    (tmp_path / "stale_module.py").write_text(textwrap.dedent('''
        def f(a):
            """Does f.

            Args:
                a: The a.
                b: An argument f no longer takes.
            """
    '''))
    plugin = next(p["mkdocstrings"] for p in real["plugins"] if isinstance(p, dict) and "mkdocstrings" in p)
    handler = plugin["handlers"]["python"]
    options = {k: v for k, v in handler["options"].items() if k != "extensions"}
    config = {
        "site_name": "contrast", "docs_dir": "docs", "strict": real["strict"],
        "validation": real["validation"], "markdown_extensions": real["markdown_extensions"],
        "nav": ["index.md"],
        "plugins": [{"mkdocstrings": {"handlers": {"python": {"paths": ["."], "options": options}}}}],
    }
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    code, output, _ = _build("mkdocs.yml", str(tmp_path / "site"), str(tmp_path), timeout=120)
    assert code != 0, output
    assert "missing.md" in output and "#nowhere" in output, output
    assert "Parameter 'b' does not appear in the function signature" in output, output


# The browser.


class _Anchors(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids = set()

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("id", "name") and value:
                self.ids.add(value)


def _serve(directory):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=directory))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _descendants():
    """Pids of this process's descendants (from /proc)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _internal_links(page, base):
    return page.evaluate("""(base) => [...document.querySelectorAll('a[href]')]
        .map(a => a.href).filter(h => h.startsWith(base))""", base)


@pytest.mark.cluster
@pytest.mark.xdist_group("docs")
@pytest.mark.timeout(240)
def test_the_site_in_a_browser(site):
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing: `bash tools/setup_browser.sh` installs Debian's "
                    "chromium (apt-get, as root)")
    from playwright.sync_api import sync_playwright

    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    os.makedirs(ARTIFACTS)
    server = _serve(site)
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    before = set(_descendants())
    problems, anchors_of, statuses = [], {}, {}
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=CHROMIUM,
                args=["--no-sandbox", "--disable-background-networking", "--disable-component-update",
                      "--disable-sync", "--no-first-run", "--disable-gpu"])
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                console = []
                page.on("console", lambda m: console.append(f"{m.type}: {m.text}")
                        if m.type in ("error", "warning") else None)
                page.on("pageerror", lambda e: console.append(f"page error: {e}"))
                page.on("requestfailed", lambda r: console.append(f"request failed: {r.url}"))
                page.on("response", lambda r: console.append(f"HTTP {r.status}: {r.url}")
                        if r.status >= 400 else None)
                for name, path in PAGES:
                    console.clear()
                    page.goto(base + path, wait_until="networkidle")
                    title = page.inner_text("article h1").strip()
                    words = len(page.inner_text("article").split())
                    if not title or words < 150:
                        problems.append(f"{name}: renders {words} words under {title!r}")
                    if name == "tutorial":
                        figures = page.locator("article img[src*='_files/']")
                        if figures.count() == 0:
                            problems.append("tutorial: no figure")
                        else:
                            figures.last.scroll_into_view_if_needed()
                            if not figures.last.evaluate("img => img.complete && img.naturalWidth > 100"):
                                problems.append("tutorial: its figure did not load")
                    page.screenshot(path=os.path.join(ARTIFACTS, f"{name}.png"))
                    for link in _internal_links(page, base):
                        target, _, anchor = link.partition("#")
                        if target not in statuses:
                            response = page.request.get(target)
                            statuses[target] = response.status
                            parser = _Anchors()
                            parser.feed(response.text() if response.ok else "")
                            anchors_of[target] = parser.ids
                        if statuses[target] != 200:
                            problems.append(f"{name}: {link} answers {statuses[target]}")
                        elif anchor and urllib.parse.unquote(anchor) not in anchors_of[target]:
                            problems.append(f"{name}: {link}: no such anchor")
                    problems += [f"{name}: console: {line}" for line in console]
                # The search finds a public function by name, and leads to its reference.
                page.goto(base, wait_until="networkidle")
                page.click("input.md-search__input")
                page.keyboard.type(SEARCHED)
                page.locator(".md-search-result__item a").first.wait_for(timeout=20000)
                page.screenshot(path=os.path.join(ARTIFACTS, "search.png"))
                found = [urllib.parse.urlsplit(h) for h in page.eval_on_selector_all(
                    ".md-search-result__item a", "as => as.map(a => a.href)")]
                wanted = {("/reference/data/", f"keras_distrib.data.{SEARCHED}"),
                          ("/reference/kd/", f"keras_distrib.{SEARCHED}")}
                if not any((f.path, f.fragment) in wanted for f in found):
                    problems.append(f"search for {SEARCHED!r} found {[f.geturl() for f in found[:5]]}")
            finally:
                browser.close()
    finally:
        server.shutdown()
        # Whatever the browser left (it should leave nothing), ended by pid.
        for pid in set(_descendants()) - before:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert len(statuses) >= 40, sorted(statuses)  # the navigation reaches every page
    assert not problems, "\n".join(problems)
