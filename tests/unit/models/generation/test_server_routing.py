"""ServerRouter's choices under a fake clock: least outstanding first, the first URL on ties,
each sample on its server while that answers, failing servers set aside with a doubling wait
and used again once it has passed."""

from __future__ import annotations

import pytest

from envloop.models.generation import server_routing
from envloop.models.generation.server_routing import MAX_SET_ASIDE_S, ServerRouter

URLS = ["http://a", "http://b", "http://c"]


class FakeClock:
    """A clock that moves only when told: ``clock.now[0]`` is the time it reads."""

    def __init__(self) -> None:
        self.now = [0.0]

    def __call__(self) -> float:
        return self.now[0]

    def advance(self, seconds: float) -> None:
        self.now[0] += seconds


def make_router(urls: list[str] = URLS, base: float = 0.5) -> tuple[ServerRouter, FakeClock]:
    clock = FakeClock()
    return ServerRouter(urls, base_set_aside_s=base, clock=clock), clock


def url_of(router: ServerRouter, key=None, *, release: bool = True) -> str:
    """The URL a request of ``key`` goes to (released as answered unless ``release`` is False)."""
    server = router.acquire(key)
    if release:
        router.release(server, ok=True)
    return server.url


def fail(router: ServerRouter, url: str, times: int = 1) -> None:
    """``times`` consecutive failed requests to ``url``, each sent once the set-aside of the
    one before has passed (the fake clock moves there)."""
    server = next(s for s in router.servers if s.url == url)
    clock = router.clock
    assert isinstance(clock, FakeClock)
    for _ in range(times):
        clock.now[0] = max(clock.now[0], server.down_until)
        server.outstanding += 1  # as if acquired
        router.release(server, ok=False)


def slot(router: ServerRouter, url: str):
    return next(s for s in router.servers if s.url == url)


def test_requests_go_to_the_server_with_fewest_outstanding():
    router, _ = make_router()
    held = [url_of(router, release=False) for _ in range(3)]
    assert held == ["http://a", "http://b", "http://c"]
    router.release(slot(router, "http://b"), ok=True)
    assert url_of(router, release=False) == "http://b"
    assert [s.outstanding for s in router.servers] == [1, 1, 1]


def test_ties_go_to_the_first_url():
    router, _ = make_router()
    assert [url_of(router) for _ in range(4)] == ["http://a"] * 4


def test_a_sample_stays_on_its_server_while_others_are_less_busy():
    router, _ = make_router()
    assert url_of(router, "sample-0", release=False) == "http://a"
    assert url_of(router, "sample-0", release=False) == "http://a"
    assert url_of(router, "sample-0") == "http://a"
    assert [s.outstanding for s in router.servers] == [2, 0, 0]
    assert url_of(router, "sample-1") == "http://b"


def test_a_set_aside_server_sends_its_samples_elsewhere_for_good():
    router, clock = make_router()
    assert url_of(router, "sample-0") == "http://a"
    fail(router, "http://a")
    assert url_of(router, "sample-0") == "http://b"
    clock.advance(10.0)  # a is back, idle, and first on ties; the sample stays on b
    assert slot(router, "http://a").healthy(clock())
    assert url_of(router, "sample-0") == "http://b"
    assert url_of(router) == "http://a"


def test_set_aside_doubles_per_consecutive_failure_up_to_the_cap():
    router, clock = make_router(base=0.5)
    clock.advance(100.0)
    server = slot(router, "http://a")
    waits = []
    for _ in range(10):
        fail(router, "http://a")
        waits.append(server.down_until - clock())
    assert MAX_SET_ASIDE_S == 60.0
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]
    assert server.failures == 10


def test_thousands_of_consecutive_failures_keep_the_capped_set_aside():
    # 2 ** 1100 no longer fits a float: the doubling stops long before.
    router, clock = make_router(base=0.5)
    server = slot(router, "http://a")
    for _ in range(1100):
        fail(router, "http://a")
    assert server.failures == 1100
    assert server.down_until - clock() == MAX_SET_ASIDE_S


def test_requests_failing_while_their_server_is_set_aside_count_as_one_failure():
    # a server killed with many requests open: they all fail within moments
    router, clock = make_router(["http://a"], base=0.5)
    server = slot(router, "http://a")
    held = [router.acquire() for _ in range(3)]
    for request in held:
        router.release(request, ok=False)
        clock.advance(0.1)
    assert (server.failures, server.down_until, server.outstanding) == (1, 0.5, 0)
    clock.advance(0.2)  # past the set-aside: the next failure doubles it
    fail(router, "http://a")
    assert (server.failures, server.down_until) == (2, 1.5)


def test_an_answered_request_resets_the_set_aside():
    router, clock = make_router(base=0.5)
    server = slot(router, "http://a")
    fail(router, "http://a", times=3)  # at 0, 0.5 and 1.5
    assert (server.failures, server.down_until) == (3, 3.5)
    server.outstanding += 1
    router.release(server, ok=True)
    assert (server.failures, server.down_until) == (0, 0.0)
    fail(router, "http://a")
    assert server.down_until - clock() == 0.5


def test_when_every_server_is_down_the_one_back_soonest_is_used():
    router, _ = make_router(base=0.5)
    fail(router, "http://a", times=3)  # at 0, 0.5 and 1.5: back at 3.5
    fail(router, "http://b", times=1)  # at 1.5: back at 2.0
    fail(router, "http://c", times=2)  # at 1.5 and 2.0: back at 3.0
    assert url_of(router) == "http://b"
    assert url_of(router, "sample-0") == "http://b"


def test_a_restarted_server_is_used_again_once_its_set_aside_has_passed():
    router, clock = make_router(["http://a", "http://b"], base=0.5)
    fail(router, "http://a")  # down until 0.5
    clock.advance(0.4)
    assert url_of(router) == "http://b"
    clock.advance(0.1)
    assert url_of(router) == "http://a"


def test_the_least_recently_used_sample_is_forgotten_past_the_limit(monkeypatch):
    monkeypatch.setattr(server_routing, "MAX_STICKY_SAMPLES", 2)
    router, _ = make_router(["http://a", "http://b"])
    first = router.acquire("sample-0")  # a
    second = router.acquire("sample-1")  # b
    assert url_of(router, "sample-0") == "http://a"  # sample-0 used more recently than sample-1
    third = router.acquire("sample-2")  # a (tie); the third sample forgets sample-1
    router.release(first, ok=True)
    router.release(third, ok=True)
    assert [s.outstanding for s in router.servers] == [0, 1]  # b still busy with sample-1
    # remembered, sample-1 would go back to b; forgotten, it goes to the idle a
    assert url_of(router, "sample-1") == "http://a"
    router.release(second, ok=True)


def test_without_the_limit_every_sample_is_remembered():
    router, _ = make_router(["http://a", "http://b"])
    busy = router.acquire("sample-1")  # a
    for n in range(10):
        url_of(router, f"other-{n}")
    assert url_of(router, "sample-1") == "http://a"
    router.release(busy, ok=True)


def test_trailing_slashes_are_stripped_from_urls():
    router = ServerRouter(["http://127.0.0.1:8000/", "http://127.0.0.1:8001//"])
    assert [s.url for s in router.servers] == ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]


@pytest.mark.parametrize("key", [None, "sample-0"])
def test_outstanding_counts_return_to_zero_after_release(key):
    router, _ = make_router()
    servers = [router.acquire(key) for _ in range(5)]
    for server in servers:
        router.release(server, ok=True)
    assert [s.outstanding for s in router.servers] == [0, 0, 0]


def test_a_request_for_several_completions_goes_to_a_server_that_takes_them():
    router, _ = make_router()
    router.servers[1].parallel = 4  # b
    router.servers[2].parallel = 2  # c
    assert router.group_size() == 1  # a takes one completion per request
    group = router.acquire("sample-0", need=3, keys=["sample-1", "sample-2"])
    assert group.url == "http://b"  # the only one taking 3, though busier after this
    assert url_of(router, "sample-2") == "http://b"  # the group's samples stick to it
    assert router.acquire(need=2).url == "http://c"  # b has 3 completions outstanding, c 0
    with pytest.raises(server_routing.NoServerTakes):
        router.acquire("sample-0", need=5)
    router.leave(router.servers[0])
    assert router.group_size() == 2  # b 4, c 2: what both take
