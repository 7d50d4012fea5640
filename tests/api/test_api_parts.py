"""The API's parts that need no service: Standard Webhooks signatures (the
specification's own example, and its library verifying ours), the resolver webhooks connect through, the tokens file,
the webhook outbox's retries and give-up (over a SQLite store, a receiver on loopback),
JSON pointers and Range headers."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import standardwebhooks
from aiohttp import web

from comfy_assets.api.files import byte_range
from comfy_assets.api.outbox import Outbox, webhook_id
from comfy_assets.api.signing import headers, load_key, signature, verify
from comfy_assets.api.submission import parse_submission, pointer
from comfy_assets.api.tokens import Clients, TokensError
from comfy_assets.api.webhook_urls import GuardedResolver, address_problem, delivery_problem
from comfy_assets.store import OutputFile, Store
from comfy_assets.store.api_jobs import ApiJob, ApiLedger
from tests.api_support import job_body
from tests.support import wait_until


def test_the_signature_of_the_specifications_example(tmp_path: Path) -> None:
    # https://github.com/standard-webhooks/standard-webhooks/blob/main/spec/standard-webhooks.md
    secret = tmp_path / "secret"
    secret.write_text("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\n")
    key = load_key(secret)
    body = b'{"test": 2432232314}'
    expected = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    assert signature(key, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body) == expected
    assert verify(key, "msg_p5jXN8AQM9LWM0D4loKWxJek", "1614265330", body, f"v1,x {expected}")
    assert not verify(key, "msg_p5jXN8AQM9LWM0D4loKWxJek", "1614265331", body, expected)


def test_a_standard_webhooks_receiver_verifies_our_deliveries(tmp_path: Path) -> None:
    # The specification's own library (standardwebhooks), as a receiver would use it.
    secret = tmp_path / "secret"
    secret.write_text("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\n")
    body = b'{"type": "job.succeeded"}'
    now = int(time.time())
    sent = headers(load_key(secret), "msg_1", now, body)
    receiver = standardwebhooks.Webhook("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    assert receiver.verify(body, sent) == {"type": "job.succeeded"}
    with pytest.raises(standardwebhooks.WebhookVerificationError):
        receiver.verify(body + b" ", sent)
    # A secret that is not whsec_<base64> is its text's bytes: given to the library as bytes.
    secret.write_text("a plain secret of 32 characters!\n")
    plain = headers(load_key(secret), "msg_2", now, body)
    standardwebhooks.Webhook(b"a plain secret of 32 characters!").verify(body, plain)


@pytest.mark.parametrize(
    ("address", "refused"),
    [
        ("127.0.0.1", True),
        ("169.254.169.254", True),
        ("10.0.0.7", True),
        ("192.168.1.1", True),
        ("100.64.0.1", True),
        ("::1", True),
        ("fd00:ec2::254", True),
        ("::ffff:127.0.0.1", True),
        ("64:ff9b::7f00:1", True),  # NAT64 of 127.0.0.1
        ("64:ff9b::a9fe:a9fe", True),  # NAT64 of 169.254.169.254
        ("64:ff9b:1::7f00:1", True),  # a local-use NAT64 prefix
        ("2002:7f00:1::", True),  # 6to4 of 127.0.0.1
        ("2002:a00:7::1", True),  # 6to4 of 10.0.0.7
        ("::127.0.0.1", True),  # IPv4-compatible (deprecated), in reserved ::/8
        ("::ffff:0:127.0.0.1", True),  # IPv4-translated, in reserved ::/8
        ("64:ff9b::5db8:d70e", False),  # NAT64 of 93.184.215.14
        ("2002:5db8:d70e::1", False),  # 6to4 of 93.184.215.14
        ("0.0.0.0", True),
        ("224.0.0.1", True),
        ("93.184.215.14", False),
        ("2606:4700::6810:85e5", False),
    ],
)
def test_which_addresses_a_webhook_may_reach(address: str, refused: bool) -> None:
    assert (address_problem(address) is not None) == refused


def test_a_refused_address_is_named_by_its_narrowest_kind() -> None:
    assert address_problem("127.0.0.1") == "127.0.0.1, a loopback address"
    assert address_problem("0.0.0.0") == "0.0.0.0, an unspecified address"
    assert address_problem("64:ff9b::7f00:1") == "127.0.0.1, a loopback address"
    assert address_problem("169.254.169.254") == "169.254.169.254, a link-local address"
    assert address_problem("10.0.0.7") == "10.0.0.7, a private address"


async def test_the_delivery_resolver_answers_only_public_addresses() -> None:
    with pytest.raises(OSError, match="loopback"):
        await GuardedResolver(allow_private=False).resolve("localhost", 80, socket.AF_INET)
    found = await GuardedResolver(allow_private=True).resolve("localhost", 80, socket.AF_INET)
    assert found[0]["host"] == "127.0.0.1"


def test_a_tokens_file_that_cannot_be_used(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    for text, what in [
        ("", "no NAME:TOKEN"),
        ("alice\n", ":1: expected NAME:TOKEN"),
        ("alice:short\n", "at least 16"),
        ("a b:0123456789abcdef\n", "expected NAME:TOKEN"),
        ("alice:0123456789abcdef\nalice:0123456789abcdeg\n", ":2: client 'alice' repeated"),
        ("alice:0123456789abcdef\nbob:0123456789abcdef\n", "another client's too"),
    ]:
        path.write_text(text)
        with pytest.raises(TokensError, match=what) as e:
            Clients.load(path)
        assert "0123456789" not in str(e.value)  # never a token
    path.write_text("# clients\nalice:0123456789abcdef\n\nbob:fedcba9876543210\n")
    clients = Clients.load(path)
    assert clients.names == ["alice", "bob"]
    assert clients.client("Bearer 0123456789abcdef") == "alice"
    assert clients.client("bearer fedcba9876543210") == "bob"
    for header in (None, "", "Bearer", "Basic 0123456789abcdef", "Bearer 0123456789abcde"):
        assert clients.client(header) is None


def test_pointers_and_ranges() -> None:
    assert pointer("set.1.color") == "/set/1.color"
    assert pointer("inputs.a/b~c.image") == "/inputs/a~1b~0c.image"
    assert pointer("json") == "" and pointer("id") == "/id"
    assert byte_range(None, 10) is None
    assert byte_range("bytes=2-4", 10) == (2, 4)
    assert byte_range("bytes=8-", 10) == (8, 9)
    assert byte_range("bytes=-3", 10) == (7, 9)
    assert byte_range("bytes=5-100", 10) == (5, 9)
    assert byte_range("bytes=10-", 10) == "unsatisfiable"
    assert byte_range("bytes=1-2,4-5", 10) is None  # several ranges: the whole file
    assert byte_range("items=1-2", 10) is None
    assert byte_range("bytes=" + "9" * 5000 + "-", 10) == "unsatisfiable"
    assert byte_range("bytes=2-" + "9" * 5000, 10) == (2, 9)
    assert byte_range("bytes=\u0663-", 10) is None  # not ASCII digits: the whole file


async def test_the_outbox_retries_then_delivers_then_gives_up(store: Store) -> None:
    """A receiver that answers 503 twice gets the webhook a third time, signed, with the
    same id; a receiver gone for longer than the give-up time gets given up on; every
    attempt is an event of its job."""
    answers = [503, 503, 204]
    got: list[tuple[str, bool]] = []
    key = b"k" * 32

    async def receive(request: web.Request) -> web.Response:
        body = await request.read()
        h = request.headers
        ok = verify(key, h["webhook-id"], h["webhook-timestamp"], body, h["webhook-signature"])
        got.append((h["webhook-id"], ok))
        return web.Response(status=answers.pop(0))

    runner, port = await _receiver(receive)
    ledger = ApiLedger(store)
    delivered, dropped = (
        _ended_job(store, ledger, f"http://127.0.0.1:{port}/hook"),
        _ended_job(store, ledger, "http://127.0.0.1:9/gone"),
    )
    outbox = Outbox(
        ledger,
        key,
        allow_private=True,
        base_delay_s=0.01,
        max_delay_s=0.02,
        give_up_after_s=6.0,
        poll_s=0.01,
    )

    task = asyncio.create_task(outbox.run())
    try:
        await wait_until(
            lambda: (
                all(h.next_at is None for j in (delivered, dropped) for h in ledger.webhooks(j))
                and bool(ledger.webhooks(delivered))
            ),
            30,
            "both webhooks delivered or given up",
        )
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await runner.cleanup()
    [hook] = ledger.webhooks(delivered)
    assert hook.webhook_id == webhook_id(delivered, store.get(delivered).finished_at)  # type: ignore[union-attr]
    assert got == [(hook.webhook_id, True)] * 3
    assert hook.delivered_at is not None and hook.attempts == 3
    notes = [e.detail for e in store.events(delivered) if (e.detail or "").startswith("webhook")]
    assert [n.rsplit(": ", 1)[-1].split(";")[0] for n in notes] == [
        "HTTP 503",
        "HTTP 503",
        "delivered",
    ]
    [gone] = ledger.webhooks(dropped)
    assert gone.given_up_at is not None and gone.delivered_at is None
    last = [e.detail for e in store.events(dropped) if (e.detail or "").startswith("webhook")][-1]
    assert "given up after 6 s" in (last or "")


async def test_a_delivery_to_a_private_address_is_not_made_whoever_accepted_it(
    store: Store,
) -> None:
    """A URL accepted by an API process allowed private addresses, delivered by one that
    is not: aiohttp connects to an address without asking the resolver, so the address
    is checked before connecting; the receiver gets nothing, the webhook is given up at
    once, and its job's event says why."""
    got: list[str] = []

    async def receive(request: web.Request) -> web.Response:
        got.append(request.path)
        return web.Response(status=204)

    runner, port = await _receiver(receive)
    ledger = ApiLedger(store)
    job = _ended_job(store, ledger, f"http://127.0.0.1:{port}/hook")
    outbox = Outbox(ledger, b"k" * 32, allow_private=False, poll_s=0.01)
    task = asyncio.create_task(outbox.run())
    try:
        await wait_until(
            lambda: any(h.next_at is None for h in ledger.webhooks(job)), 30, "an outcome"
        )
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await runner.cleanup()
    [hook] = ledger.webhooks(job)
    assert got == []
    assert hook.given_up_at is not None and hook.attempts == 1
    [note] = [e.detail for e in store.events(job) if (e.detail or "").startswith("webhook")]
    assert note.endswith(
        "not called: its host is 127.0.0.1, a loopback address (refused unless "
        "--allow-private-webhooks); given up"
    )


def test_which_urls_are_refused_before_a_delivery_connects() -> None:
    assert "loopback" in (delivery_problem("http://[::1]:8/h", allow_private=False) or "")
    assert "reserved" in (delivery_problem("http://[::127.0.0.1]/", allow_private=False) or "")
    assert delivery_problem("http://127.0.0.1/h", allow_private=True) is None
    assert delivery_problem("http://93.184.215.14/h", allow_private=False) is None
    assert delivery_problem("http://localhost/h", allow_private=False) is None  # the resolver's
    assert delivery_problem("ftp://93.184.215.14/", allow_private=True) is not None


async def _receiver(
    receive: Callable[[web.Request], Awaitable[web.Response]],
) -> tuple[web.AppRunner, int]:
    """A webhook receiver on loopback answering POST /hook with ``receive``: its runner
    (the caller cleans it up) and its port."""
    app = web.Application()
    app.router.add_post("/hook", receive)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


def _ended_job(store: Store, ledger: ApiLedger, url: str, client: str = "alice") -> str:
    body = job_body()
    partition = f"api-{client}"
    sub = parse_submission(body, partition=partition, max_input_bytes=10, max_message_bytes=10**6)
    row = ApiJob(sub.job.id, client, sub.content, sub.message, url, store.now())
    ledger.take(row, partition, sub.job)
    assert store.claim(sub.job.id, "test-owner") == "claimed"
    store.mark_done(sub.job.id, "test-owner", files=[OutputFile("a.png", "0" * 64, 1)])
    return sub.job.id


def test_the_api_command_refuses_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from comfy_assets.cli.main import main

    monkeypatch.delenv("COMFY_ASSETS_RABBITMQ_URL", raising=False)
    tokens = tmp_path / "tokens"
    tokens.write_text("alice:short\n")
    base = ["api", "--store", str(tmp_path / "store"), "--tokens", str(tokens)]
    assert main(base) == 2
    assert "no RabbitMQ URL" in capsys.readouterr().err
    amqp = ["--rabbitmq", "amqp://guest:guest@127.0.0.1:5672/"]
    assert main([*base, *amqp]) == 2
    err = capsys.readouterr().err
    assert f"--tokens {tokens}:1: the token of 'alice' must have at least 16" in err
    assert "short" not in err
    tokens.write_text("alice:0123456789abcdef\n")
    secret = tmp_path / "secret"
    secret.write_text("whsec_not base64!\n")
    assert main([*base, *amqp, "--webhook-secret-file", str(secret)]) == 2
    assert "not base64 after whsec_" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main([*base, *amqp, "--listen", "nowhere"])
    assert e.value.code == 2
    assert "expected HOST:PORT, got 'nowhere'" in capsys.readouterr().err
    assert not (tmp_path / "store").exists()  # nothing was created
