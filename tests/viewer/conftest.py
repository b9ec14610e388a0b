"""Fixtures of the viewer tests: a service with auth, kept requests and a tokenizer, and a real
headless Chromium (the Debian ``chromium`` and its ``chromedriver`` on PATH, driven by Selenium;
the tests skip when they are not installed: ``make test-deps`` installs them)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from integration.http_support import Server, start_server

TOKENS = {"viewer-secret": ["team-a", "team-stats"], "other-secret": ["team-b"]}
KEEP = 8
# A word-level vocabulary: id i is WORDS[i] (the tokenizer file the service loads).
WORDS = ["<unk>", "the", " answer", " is", " 42", "\n", "Wait", ",", " no", " 7", "."] + [
    f"w{i}" for i in range(11, 64)
]


def write_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="session")
def viewer_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    directory = tmp_path_factory.mktemp("viewer")
    tokens_file = directory / "tokens.json"
    tokens_file.write_text(json.dumps({"tokens": TOKENS}))
    srv = start_server(
        directory,
        auth_tokens_file=str(tokens_file),
        viewer_keep=KEEP,
        tokenizer=str(write_tokenizer(directory / "tokenizer.json")),
        max_request_tokens=200_000,
    )
    yield srv
    srv.stop()


def chromium_paths() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """One headless Chromium for the session (``--no-sandbox``: the tests may run as root)."""
    paths = chromium_paths()
    if paths is None:
        pytest.skip("chromium and chromedriver are not installed (make test-deps installs them)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (the dev extra has it)")
    options = webdriver.ChromeOptions()
    options.binary_location = paths[0]
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
        "--lang=en-US",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=paths[1]))
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()
