"""The viewer in a real headless Chromium: the page's testing contract (every token an element
whose data-advantage is the API's number), the shading's sides, a KTAE token's table as the
oracle computes it, the paste path, auth, a 4096-token rollout's render time, accessibility, and
the new methods' explanations (GTPO's shaped reward, HICRA's planning flag and bonus, MaxRL's
success rate).

Screenshots go to the test's temporary directory (``viewer-*.png``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gdpo_oracle import weighted_sums
from integration.http_support import Server, start_server
from oracle import ktae_group_statistics, resolve_estimator
from stats.redis_support import RedisServer
from viewer.viewer_support import ktae_request, long_request

AUTH = {"Authorization": "Bearer viewer-secret"}
AXE = Path(__file__).with_name("vendor") / "axe-core" / "axe.min.js"
# The stated budget for a 4096-token rollout: from navigation to every token shaded.
LONG_ROLLOUT_SECONDS = 3.0
# The page's tokens, in document order: (token id, data-advantage, rollout, group).
READ_TOKENS = """
return [...document.querySelectorAll('[data-token-id]')].map(e => [
  e.dataset.tokenId, e.dataset.advantage ?? null,
  e.closest('[data-rollout]').dataset.rollout, e.closest('[data-group]').dataset.group]);
"""


def wait_for(driver: Any, states: tuple[str, ...] = ("ready",), timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = driver.execute_script("return document.body.dataset.state || ''")
        if state in states:
            return str(state)
        time.sleep(0.02)
    raise AssertionError(f"the page did not reach {states}; error: {error_text(driver)!r}")


def error_text(driver: Any) -> str:
    return str(
        driver.execute_script(
            "const e = document.getElementById('error'); return e.hidden ? '' : e.textContent"
        )
    )


def open_viewer(
    driver: Any, server: Server, query: str = "", token: str | None = "viewer-secret"
) -> None:
    """The page with ``token`` kept in the tab (as the form keeps it), then ``query`` opened."""
    driver.get(f"{server.url}/viewer")
    driver.execute_script(
        "sessionStorage.clear();"
        " if (arguments[0]) sessionStorage.setItem('advantage-viewer-token', arguments[0]);",
        token,
    )
    driver.get(f"{server.url}/viewer{query}")


def expected_tokens(request: dict[str, Any], response: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for group, answered in zip(request["groups"], response["groups"], strict=True):
        for i, (rollout, out) in enumerate(
            zip(group["rollouts"], answered["rollouts"], strict=True)
        ):
            for token, advantage in zip(rollout["tokens"], out["advantages"], strict=True):
                rows.append([str(token), advantage, str(i), group["id"]])
    return rows


def assert_contract(driver: Any, request: dict[str, Any], response: dict[str, Any]) -> None:
    got = driver.execute_script(READ_TOKENS)
    want = expected_tokens(request, response)
    assert len(got) == len(want)
    # (the page prints the number in JavaScript's shortest form: the same number)
    assert [[t, float(a), r, g] for t, a, r, g in got] == want
    both = driver.execute_script(
        "return document.querySelectorAll('[data-token-id][data-advantage]').length"
    )
    assert both == len(want)


def rgb(css: str) -> tuple[float, ...]:
    inner = css[css.index("(") + 1 : css.index(")")]
    return tuple(float(x) for x in inner.split(",")[:3])


def test_a_kept_request_opens_by_id_with_the_apis_numbers_after_sign_in(
    browser: Any, viewer_server: Server, tmp_path: Path
) -> None:
    """Opened without a token the page says so (401); with the token entered in the form it
    shows every token with the API's advantage; positive and negative tokens are shaded on
    opposite sides; hovering a KTAE token shows its table with the oracle's numbers."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    request = ktae_request("browser-kept", seed=5)
    response = viewer_server.client.post("/v1/advantages", json=request, headers=AUTH).json()
    open_viewer(browser, viewer_server, "?request_id=browser-kept&namespace=team-a", token=None)
    wait_for(browser, ("error",))
    assert "not signed in" in error_text(browser)
    browser.find_element(By.ID, "token").send_keys("viewer-secret")
    browser.find_element(By.CSS_SELECTOR, "#auth-form button").click()
    wait_for(browser)
    assert error_text(browser) == ""
    assert_contract(browser, request, response)

    tokens = browser.find_elements(By.CSS_SELECTOR, ".tok")
    advantages = [float(t.get_attribute("data-advantage")) for t in tokens]
    positive = tokens[int(np.argmax(advantages))]
    negative = tokens[int(np.argmin(advantages))]
    assert max(advantages) > 0 > min(advantages)
    pos = rgb(positive.value_of_css_property("background-color"))
    neg = rgb(negative.value_of_css_property("background-color"))
    assert pos != neg and pos[0] > pos[2] and neg[2] > neg[0]

    # The KTAE token with the largest |score|: its table is the oracle's.
    flat = [
        (g, i, t)
        for g in range(2)
        for i in range(4)
        for t in range(len(request["groups"][g]["rollouts"][i]["tokens"]))
    ]
    scores = [response["groups"][g]["rollouts"][i]["ktae_score"][t] for g, i, t in flat]
    k = int(np.argmax(np.abs(scores)))
    g, i, t = flat[k]
    ActionChains(browser).move_to_element(tokens[k]).perform()
    stats = browser.execute_script(
        "return Object.fromEntries([...document.querySelectorAll('#ktae-details [data-stat]')]"
        ".map(e => [e.dataset.stat, Number(e.dataset.value)]))"
    )
    group = request["groups"][g]["rollouts"]
    oracle = ktae_group_statistics(
        [r["tokens"] for r in group],
        [r["reward"] for r in group],
        resolve_estimator("ktae")["ktae"],
        set(),
    )[i]
    names = {
        "a": "ktae_a",
        "b": "ktae_b",
        "n_correct": "ktae_n_correct",
        "n_wrong": "ktae_n_wrong",
        "p": "ktae_p",
        "F": "ktae_fisher",
        "IG": "ktae_ig",
        "h": "ktae_h",
        "tf": "ktae_tf",
        "score": "ktae_score",
    }
    for stat, name in names.items():
        np.testing.assert_allclose(stats[stat], oracle[name][t], rtol=1e-5, atol=1e-6, err_msg=stat)
    assert stats["c"] == stats["n_correct"] - stats["a"]
    text = browser.find_element(By.ID, "detail-body").text
    assert "KTAE contingency table" in text and "outcome term" in text
    browser.save_screenshot(str(tmp_path / "viewer-ktae.png"))


def paste_and_compute(browser: Any, server: Server, request: dict[str, Any]) -> None:
    from selenium.webdriver.common.by import By

    open_viewer(browser, server)
    wait_for(browser, ("idle",))
    box = browser.find_element(By.ID, "request-json")
    browser.execute_script("arguments[0].value = arguments[1]", box, json.dumps(request))
    browser.find_element(By.ID, "compute").click()
    wait_for(browser)


def test_a_pasted_request_is_computed_through_the_api(
    browser: Any, viewer_server: Server, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    request = ktae_request("browser-pasted", seed=9)
    del request["return"]
    paste_and_compute(browser, viewer_server, request)
    want = viewer_server.client.post(
        "/v1/advantages", json={**request, "request_id": "browser-pasted-check"}, headers=AUTH
    ).json()
    assert_contract(browser, request, want)
    options = [
        o.get_attribute("value") for o in browser.find_elements(By.CSS_SELECTOR, "#shade option")
    ]
    assert options[:2] == ["advantages", "ktae_score"] and "ktae_p" in options
    # The paste asked for every diagnostic: the details explain each token.
    browser.find_elements(By.CSS_SELECTOR, ".tok")[0].click()
    assert browser.find_elements(By.ID, "ktae-table")
    # Token text from the tokenizer the service loaded (word 1 is "the").
    texts = browser.execute_script(
        "return [...document.querySelectorAll('.tok')].map(e => [e.dataset.tokenId, e.textContent])"
    )
    assert ["1", "the"] in texts or all(t != "1" for t, _ in texts)
    browser.save_screenshot(str(tmp_path / "viewer-pasted.png"))


DETAILS = (
    "return Object.fromEntries([...document.querySelectorAll('#detail-body [data-stat]')]"
    ".map(e => [e.dataset.stat, e.dataset.value]))"
)


def test_the_new_methods_explain_each_tokens_share(
    browser: Any, viewer_server: Server, tmp_path: Path
) -> None:
    """GTPO's shaped reward, HICRA's planning flag and bonus (the server's tokenizer finds
    "Wait", a strategic phrase, without a planning_mask), MaxRL's success rate: each token's
    details show the API's numbers."""
    from selenium.webdriver.common.by import By

    tokens = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 9, 10], [6, 7, 1, 2, 3, 4]]
    request = {
        "namespace": "team-a",
        "estimator": {"outcome": "gtpo", "hicra": {"alpha": 0.5}},
        "groups": [
            {
                "id": "p",
                "rollouts": [
                    {
                        "tokens": ids,
                        "reward": reward,
                        "entropy": [0.25 * (k % 4 + 1) for k in range(len(ids))],
                    }
                    for ids, reward in zip(tokens, [1.0, 0.0, 0.0], strict=True)
                ],
            }
        ],
    }
    paste_and_compute(browser, viewer_server, request)
    every = ["scalar", "gtpo_reward", "planning_mask", "hicra_bonus"]
    want = viewer_server.client.post(
        "/v1/advantages", json={**request, "return": every}, headers=AUTH
    ).json()
    assert_contract(browser, request, want)
    spans = browser.find_elements(By.CSS_SELECTOR, '[data-group="p"] .tok')
    wait_token = spans[5]  # rollout 0, token 5: "Wait"
    assert wait_token.get_attribute("data-token-id") == "6"
    wait_token.click()
    shown = browser.execute_script(DETAILS)
    answer = want["groups"][0]["rollouts"][0]
    assert answer["planning_mask"][5] == 1.0 and shown["planning_mask"] == "yes"
    assert float(shown["hicra_bonus"]) == pytest.approx(answer["hicra_bonus"][5], rel=1e-6)
    assert float(shown["gtpo_reward"]) == pytest.approx(answer["gtpo_reward"][5], rel=1e-6)
    spans[0].click()
    assert browser.execute_script(DETAILS)["planning_mask"] == "no"
    browser.save_screenshot(str(tmp_path / "viewer-gtpo-hicra.png"))

    maxrl = {"namespace": "team-a", "estimator": "maxrl", "groups": [{"id": "m", "rollouts": [
        {"tokens": ids, "reward": r} for ids, r in zip(tokens, [1.0, 0.0, 0.0], strict=True)
    ]}]}  # fmt: skip
    paste_and_compute(browser, viewer_server, maxrl)
    browser.find_elements(By.CSS_SELECTOR, '[data-group="m"] .tok')[0].click()
    shown = browser.execute_script(DETAILS)
    assert float(shown["maxrl_rate"]) == pytest.approx(1 / 3)
    assert float(shown["scalar"]) == pytest.approx(2.0)  # (N - K) / K = 2
    assert float(shown["advantage"]) == pytest.approx(2.0)

    # GDPO: each component's weighted normalised share, against the slow reference.
    components = [
        {"accuracy": 1.0, "format": 1.0},
        {"accuracy": 0.0, "format": 0.0},
        {"accuracy": 0.0, "format": None},
    ]
    weights = {"format": 0.5}
    gdpo = {"namespace": "team-a", "estimator": {"outcome": {"name": "gdpo", "weights": weights}},
            "groups": [{"id": "d", "rollouts": [
                {"tokens": ids, "reward_components": c}
                for ids, c in zip(tokens, components, strict=True)
            ]}]}  # fmt: skip
    paste_and_compute(browser, viewer_server, gdpo)
    browser.find_elements(By.CSS_SELECTOR, '[data-group="d"] .tok')[0].click()
    shown = browser.execute_script(DETAILS)
    group = [(c, len(ids)) for c, ids in zip(components, tokens, strict=True)]
    sums, _ = weighted_sums([group], weights, "verl")
    accuracy_only, _ = weighted_sums([group], {"format": 0.0}, "verl")
    assert float(shown["gdpo_sum"]) == pytest.approx(sums[0], rel=1e-5)
    assert float(shown["gdpo_share_accuracy"]) == pytest.approx(accuracy_only[0], rel=1e-5)
    assert float(shown["gdpo_share_format"]) == pytest.approx(sums[0] - accuracy_only[0], abs=1e-5)


def test_a_namespace_the_token_may_not_read_is_a_403_on_the_page(
    browser: Any, viewer_server: Server
) -> None:
    viewer_server.client.post("/v1/advantages", json=ktae_request("browser-403"), headers=AUTH)
    open_viewer(browser, viewer_server, "?request_id=browser-403&namespace=team-a", "other-secret")
    wait_for(browser, ("error",))
    assert "permission denied" in error_text(browser)
    assert browser.execute_script("return document.getElementById('error').dataset.status") == "403"
    assert browser.execute_script("return document.querySelectorAll('[data-token-id]').length") == 0


def test_a_4096_token_rollout_renders_in_time(
    browser: Any, viewer_server: Server, tmp_path: Path
) -> None:
    request = long_request("browser-long", 4096)
    response = viewer_server.client.post("/v1/advantages", json=request, headers=AUTH).json()
    open_viewer(browser, viewer_server)
    start = time.monotonic()
    browser.get(f"{viewer_server.url}/viewer?request_id=browser-long&namespace=team-a")
    wait_for(browser, timeout=20.0)
    seconds = time.monotonic() - start
    assert_contract(browser, request, response)
    assert seconds < LONG_ROLLOUT_SECONDS, f"{seconds:.2f} s"
    browser.save_screenshot(str(tmp_path / "viewer-long.png"))


def luminance(color: tuple[float, ...]) -> float:
    def linear(c: float) -> float:
        c /= 255.0
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (linear(c) for c in color[:3])
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def test_the_page_is_accessible_and_tokens_take_keyboard_focus(
    browser: Any, viewer_server: Server
) -> None:
    """axe-core (vendored) finds no serious or critical violation; the text on every shade
    keeps WCAG AA contrast (4.5:1); Tab reaches a token and the arrow keys move along."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    viewer_server.client.post(
        "/v1/advantages", json=ktae_request("browser-a11y", seed=3), headers=AUTH
    )
    open_viewer(browser, viewer_server, "?request_id=browser-a11y&namespace=team-a")
    wait_for(browser)
    browser.execute_script(AXE.read_text())
    result = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "axe.run(document, {resultTypes: ['violations']}).then(r => done({passes: r.passes.length,"
        " violations: r.violations.map(v => ({id: v.id, impact: v.impact, help: v.help}))}));"
    )
    assert result["passes"] > 10  # axe ran its rules over the page
    serious = [v for v in result["violations"] if v["impact"] in ("serious", "critical")]
    assert not serious, serious

    pairs = browser.execute_script(
        "return [...document.querySelectorAll('.tok')].map(e => {const s = getComputedStyle(e);"
        " return [s.color, s.backgroundColor];})"
    )
    ratios = []
    for fg, bg in {tuple(p) for p in pairs}:
        lf, lb = luminance(rgb(fg)), luminance(rgb(bg))
        ratios.append((max(lf, lb) + 0.05) / (min(lf, lb) + 0.05))
    assert min(ratios) >= 4.5, min(ratios)

    for _ in range(60):
        ActionChains(browser).send_keys(Keys.TAB).perform()
        if browser.execute_script("return document.activeElement.classList.contains('tok')"):
            break
    else:
        pytest.fail("Tab never reached a token")
    first = browser.execute_script("return document.activeElement.dataset.t")
    ActionChains(browser).send_keys(Keys.ARROW_RIGHT).perform()
    assert browser.execute_script("return document.activeElement.dataset.t") == str(int(first) + 1)
    assert "advantage" in browser.find_element("id", "detail-body").text


def test_the_namespace_statistics_show_as_a_sortable_table_with_text(
    browser: Any, viewer_server: Server
) -> None:
    from selenium.webdriver.common.by import By

    # A namespace of its own, its statistics written (asynchronously) before the page reads.
    request = ktae_request("browser-stats", namespace="team-stats")
    viewer_server.client.post("/v1/advantages", json=request, headers=AUTH)
    deadline = time.monotonic() + 10
    while True:
        stats = viewer_server.client.get(
            "/v1/stats/tokens", params={"namespace": "team-stats", "limit": 50}, headers=AUTH
        ).json()
        if stats["rollouts_counted"] == 8:
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    open_viewer(browser, viewer_server, "?namespace=team-stats")
    wait_for(browser, ("idle",))
    browser.find_element(By.ID, "load-stats").click()
    deadline = time.monotonic() + 10
    while not browser.find_elements(By.CSS_SELECTOR, "#stats-table tbody tr"):
        assert time.monotonic() < deadline, error_text(browser)
        time.sleep(0.05)
    rows = browser.execute_script(
        "return [...document.querySelectorAll('#stats-table tbody tr')]"
        ".map(r => Number(r.dataset.statToken))"
    )
    assert rows == [t["token_id"] for t in stats["tokens"]]
    assert browser.find_elements(By.CSS_SELECTOR, "#stats-table .bar-fill")
    browser.find_element(By.CSS_SELECTOR, "button[data-sort='token_id']").click()
    ids = browser.execute_script(
        "return [...document.querySelectorAll('#stats-table tbody tr')]"
        ".map(r => Number(r.dataset.statToken))"
    )
    assert ids == sorted(ids, reverse=True)
    assert '"the"' in browser.find_element(By.ID, "stats-table").text


@pytest.mark.integration
def test_kept_requests_in_redis_while_it_is_down_are_a_503_on_the_page(
    browser: Any, redis_server: RedisServer, tmp_path: Path
) -> None:
    server = start_server(tmp_path, redis_url=redis_server.url, viewer_keep=4)
    try:
        assert server.client.post("/v1/advantages", json=ktae_request("redis-1")).status_code == 200
        redis_server.kill()
        open_viewer(browser, server, "?request_id=redis-1&namespace=team-a", token=None)
        wait_for(browser, ("error",))
        assert "HTTP 503" in error_text(browser) and "Redis" in error_text(browser)
        status = browser.execute_script("return document.getElementById('error').dataset.status")
        assert status == "503"
        browser.save_screenshot(str(tmp_path / "viewer-redis-down.png"))
    finally:
        server.stop()
