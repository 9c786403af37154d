"""One model across two ranks (MLX's ring backend on loopback): rank 0 serves
HTTP, rank 1 its shard, and both run the same engine loop in lock step.

Through the real processes (``python -m mlxtrio serve`` per rank), real
sockets and the official SDKs: greedy output equals one rank's on both APIs
(tool calls held to their grammar, concurrent sequences, prefix-cache reuse);
a hang-up frees the slot on every rank; a rank that dies or stops answering
fails the server cleanly, never a hang; rank 1 leaves when rank 0 does; and
the documented ``mlx.launch`` command serves.

The embedded model computes in float32 here: a sharded layer sums partial
products across ranks, so in bfloat16 its rounding differs from one rank's
and greedy decoding may part at a near tie; in float32 it does not.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from mlxtrio.engine.commands import Cancel, Share, Submit, decode, encode
from mlxtrio.engine.handle import GenerationHandle
from mlxtrio.engine.types import Entry, GrammarConstraint, Match, SamplingParams, TextConstraint

from .conftest import (
    MODEL,
    SCRIPTED,
    anthropic_client,
    free_port,
    free_port_run,
    openai_client,
    start_server,
)
from .ranks import PYTHON, Ranks, launch_ranks, stop_all
from .test_embedded_model import ANTHROPIC_TOOLS, FORECAST, RUN

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="MLX's ring backend")

FLOAT32 = ("--compute-dtype", "float32")
PROC = Path("/proc/self/stat").exists()  # processes' CPU time (Linux)


async def _conversation(url: str) -> dict[str, Any]:
    """Greedy turns through both SDKs: what the model said, call by call."""
    said: dict[str, Any] = {}
    async with openai_client(url) as client:
        plain = await client.responses.create(
            model=MODEL, input="Hello there!", max_output_tokens=48, temperature=0
        )
        said["plain"] = plain.output_text
        # The same turn twice: the second starts from the KV the first left.
        for key in ("call", "again"):
            turn = await client.responses.create(
                model=MODEL,
                input="What's the weather in Lisbon?",
                tools=[FORECAST, RUN],
                max_output_tokens=96,
                temperature=0,
            )
            said[key] = [(i.type, getattr(i, "arguments", None)) for i in turn.output]
        said["again_cached"] = turn.usage.input_tokens_details.cached_tokens > 0
        deltas = []
        stream = await client.responses.create(
            model=MODEL, input="Tell me a story.", max_output_tokens=40, stream=True, temperature=0
        )
        async for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        said["streamed"] = "".join(deltas)

        async def one(prompt: str) -> None:
            r = await client.responses.create(
                model=MODEL, input=prompt, max_output_tokens=32, temperature=0
            )
            said[f"batch {prompt}"] = r.output_text

        async with trio.open_nursery() as nursery:  # decoded side by side, one batch
            for prompt in ("Hi!", "Run ls.", "Who are you?"):
                nursery.start_soon(one, prompt)
    async with anthropic_client(url) as client:
        message = await client.messages.create(
            model="claude-sonnet-4-5",
            max_tokens=96,
            extra_body={"temperature": 0},
            tools=ANTHROPIC_TOOLS,
            messages=[{"role": "user", "content": "Run `git status` please."}],
        )
        said["messages"] = [block.model_dump() for block in message.content]
    return said


async def test_two_ranks_answer_as_one_rank_does(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        solo = await start_server(nursery, compute_dtype="float32")
        expected = await _conversation(solo.url)
        nursery.cancel_scope.cancel()
    async with launch_ranks(tmp_path, *FLOAT32, "--data-dir", str(tmp_path / "data")) as ranks:
        health = await ranks.wait_ready()
        assert health["world"]["size"] == 2
        got = await _conversation(ranks.url)
        health = (await ranks.health()).json()
    assert _without_ids(got) == _without_ids(expected)
    assert got["again_cached"] and any(t == "function_call" for t, _ in got["call"])
    steps = {rank["steps"] for rank in health["world"]["ranks"]}
    assert len(steps) == 1 and steps.pop() > 0  # every rank took every step
    assert [r["pid"] for r in health["world"]["ranks"]] == [p.pid for p in ranks.procs]


def _without_ids(said: dict[str, Any]) -> dict[str, Any]:
    text = json.dumps(said, sort_keys=True)
    for block in said["messages"]:
        if block.get("id"):
            text = text.replace(block["id"], "ID")
    return dict(json.loads(text))


async def _rank_states(ranks: Ranks) -> list[dict[str, Any]]:
    return list((await ranks.health()).json()["world"]["ranks"])


async def test_a_hang_up_frees_the_slot_on_every_rank(
    tmp_path: Path, scripted_model_path: str
) -> None:
    args = ("--model", scripted_model_path, "--model-name", SCRIPTED)
    async with launch_ranks(tmp_path, *args, "--data-dir", str(tmp_path / "d")) as ranks:
        await ranks.wait_ready()
        body = {"model": SCRIPTED, "input": "LOOP", "stream": True, "max_output_tokens": 30000}
        async with ranks.client() as client:
            async with client.stream("POST", "/v1/responses", json=body) as stream:
                deltas = 0
                async for line in stream.aiter_lines():
                    deltas += "output_text.delta" in line
                    if deltas == 20:
                        break
                busy = await _rank_states(ranks)
                assert [r["active_sequences"] for r in busy] == [1, 1]
        # The hang-up reaches rank 0's engine, and through it every rank.
        with trio.fail_after(10):
            while True:
                states = await _rank_states(ranks)
                if all(r["active_sequences"] == 0 for r in states):
                    break
                await trio.sleep(0.1)
        assert len({r["steps"] for r in states}) == 1
        with trio.fail_after(5):  # the cancelled prefix is kept on every rank alike
            while len({r["kv_snapshots"] for r in await _rank_states(ranks)}) != 1:
                await trio.sleep(0.1)
        async with openai_client(ranks.url) as client:
            after = await client.responses.create(model=SCRIPTED, input="hi")
        assert after.output_text == "Hello world."
        if PROC:
            # Idle, rank 1 waits for rank 0's doorbell in the kernel: MLX's
            # ring backend would spin a core in the collective instead.
            before = _cpu_seconds(ranks.procs[1].pid)
            await trio.sleep(3)
            assert _cpu_seconds(ranks.procs[1].pid) - before < 1.0


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _stream_until_decoding(ranks: Ranks, nursery: trio.Nursery) -> list[str]:
    """Start a never-ending stream in the background; returns its lines so far
    (the list grows), once it decodes."""
    lines: list[str] = []
    decoding = trio.Event()

    async def read() -> None:
        body = {"model": SCRIPTED, "input": "LOOP", "stream": True, "max_output_tokens": 30000}
        async with ranks.client() as client:
            async with client.stream("POST", "/v1/responses", json=body) as stream:
                async for line in stream.aiter_lines():
                    lines.append(line)
                    if "output_text.delta" in line:
                        decoding.set()
        decoding.set()

    nursery.start_soon(read)
    await decoding.wait()
    return lines


async def _watch_health_until_exit(ranks: Ranks, timeout: float = 30) -> list[int]:
    """/health statuses until rank 0 exits (0: connection refused)."""
    seen: list[int] = []
    with trio.fail_after(timeout):
        while ranks.procs[0].returncode is None:
            try:
                seen.append((await ranks.health()).status_code)
            except Exception:
                seen.append(0)
            await trio.sleep(0.05)
    return seen


@pytest.mark.parametrize("how", ["dies", "stops answering"])
async def test_a_lost_rank_fails_the_server_cleanly(
    tmp_path: Path, scripted_model_path: str, how: str
) -> None:
    args = ("--model", scripted_model_path, "--model-name", SCRIPTED, "--rank-timeout", "2")
    async with launch_ranks(tmp_path, *args, "--data-dir", str(tmp_path / "d")) as ranks:
        await ranks.wait_ready()
        async with trio.open_nursery() as nursery:
            lines = await _stream_until_decoding(ranks, nursery)
            if how == "dies":
                ranks.procs[1].kill()
            else:  # alive, its sockets open, but silent
                ranks.procs[1].send_signal(signal.SIGSTOP)
            seen = await _watch_health_until_exit(ranks)
        status = await ranks.wait_exit(0)
        log = ranks.log(0)
    assert status == 1
    assert 503 in seen and seen[-1] in (0, 503), seen
    assert any("response.failed" in line for line in lines), lines[-3:]
    # A dead rank's connections close: the ring backend or rank 0's doorbell
    # says so, whichever rank 0 was using; unless rank 0 was inside one of the
    # ring's collectives, which may wait on without noticing: then the
    # watchdog's rank_timeout ends it, as it does for a rank that is silent.
    reasons = ["no answer from the other ranks"]
    if how == "dies":
        reasons.append("connection was lost")
    errors = [line for line in log.splitlines() if "ERROR mlxtrio.engine" in line]
    assert errors and "shutting down" in errors[0], log[-2000:]
    error = errors[0].replace("connection to a peer was lost", "connection was lost")
    assert any(reason in error for reason in reasons), error
    assert "Traceback" not in log


async def test_the_other_ranks_leave_when_rank_0_dies(
    tmp_path: Path, scripted_model_path: str
) -> None:
    args = ("--model", scripted_model_path, "--model-name", SCRIPTED)
    async with launch_ranks(tmp_path, *args, "--data-dir", str(tmp_path / "d")) as ranks:
        await ranks.wait_ready()
        ranks.procs[0].kill()
        status = await ranks.wait_exit(1, timeout=15)
        log = ranks.log(1)
    assert status == 1
    assert "rank 1: the distributed engine failed" in log and "exiting" in log, log[-2000:]


async def test_mlx_launch_serves_and_shuts_down_the_world(
    tmp_path: Path, scripted_model_path: str
) -> None:
    """The README's command: ``mlx.launch --backend ring -n 2 --hosts
    127.0.0.1 -m mlxtrio serve``; SIGTERM to rank 0 ends every rank with 0."""
    launcher = Path(PYTHON).parent / "mlx.launch"
    port = free_port()
    first_ring_port = free_port_run(2)  # the ring takes this port and the next
    command = [
        str(launcher),
        "--backend",
        "ring",
        "-n",
        "2",
        "--hosts",
        "127.0.0.1",
        "--starting-port",
        str(first_ring_port),
        "--python",
        PYTHON,
        "-m",
        "mlxtrio",
        "serve",
        "--port",
        str(port),
        "--model",
        scripted_model_path,
        "--model-name",
        SCRIPTED,
        "--data-dir",
        str(tmp_path / "d"),
    ]
    log = tmp_path / "launch.log"
    with log.open("wb") as out:
        proc = await trio.lowlevel.open_process(command, stdout=out, stderr=out, env=os.environ)
    try:
        ranks = Ranks(port, [proc], [log])
        health = await ranks.wait_ready()
        assert health["world"]["size"] == 2
        async with openai_client(ranks.url) as client:
            answer = await client.responses.create(model=SCRIPTED, input="hi")
        assert answer.output_text == "Hello world."
        os.kill(health["world"]["ranks"][0]["pid"], signal.SIGTERM)
        with trio.fail_after(30):
            status = await proc.wait()
    finally:
        await stop_all([proc])
    text = log.read_text(errors="replace")
    assert status == 0, text[-2000:]
    assert "rank 1: rank 0 ended the world" in text


def test_commands_cross_ranks_as_plain_data() -> None:
    """A batch's wire form names handles by serial number and carries what
    the other ranks need: prompt, sampling, constraints (grammars by their
    source), the cache match; the other commands find the copy it made."""
    grammar = GrammarConstraint(object(), after=7, repeat=True, source='start: "x"')
    sampling = SamplingParams(
        temperature=0.5,
        max_tokens=9,
        seed=3,
        stop_token_ids=(5,),
        constraints=(TextConstraint(("a", "b"), after=7, repeat=True), grammar),
    )
    handle = GenerationHandle([1, 2, 3], sampling, lambda h: None, ("m", "d"), None)
    handle.serial, handle.boundary = 41, 2
    handle.match = Match(Entry(12, ("m", "d"), [1, 2], 0, True), 2)
    compiled: list[str] = []

    def compile_grammar(source: str) -> str:
        compiled.append(source)
        return "compiled"

    copies: dict[int, GenerationHandle] = {}
    batch = encode([Submit(handle), Share(handle, 3), Cancel(handle)])
    submit, share, cancel = decode(batch, copies, compile_grammar)
    copy = copies[41]
    assert isinstance(submit, Submit) and submit.handle is copy and not submit.withdrawn
    assert isinstance(share, Share) and share.handle is copy and share.at == 3
    assert isinstance(cancel, Cancel) and cancel.handle is copy
    assert (copy.prompt, copy.boundary, copy.cache_key) == ([1, 2, 3], 2, ("m", "d"))
    assert copy.match is not None and copy.match.entry is not None
    assert (copy.match.entry.id, copy.match.length) == (12, 2)
    text, got = copy.sampling.constraints
    assert text == sampling.constraints[0]
    assert isinstance(got, GrammarConstraint) and got.grammar == "compiled"
    assert compiled == ['start: "x"']
    assert (copy.sampling.temperature, copy.sampling.seed, copy.sampling.stop_token_ids) == (
        0.5,
        3,
        (5,),
    )
    # A command for a sequence this rank no longer holds is left out.
    assert decode(encode([Cancel(handle)]), {}, compile_grammar) == []


@pytest.fixture(scope="module")
def pipeline_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 4-layer Qwen2 with random float32 weights and a weight index (what
    pipeline sharding needs, as hub checkpoints have): qwen3, the embedded
    model's family, has tensor parallelism only."""
    import shutil

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen2

    from mlxtrio.settings import EMBEDDED_MODEL_PATH

    out = tmp_path_factory.mktemp("qwen2-pipeline")
    for item in EMBEDDED_MODEL_PATH.iterdir():
        if item.name not in ("model.safetensors", "config.json"):
            shutil.copy(item, out / item.name)
    config = json.loads((EMBEDDED_MODEL_PATH / "config.json").read_text())
    config.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    config.update(tie_word_embeddings=False)
    config.pop("head_dim")
    (out / "config.json").write_text(json.dumps(config))
    mx.random.seed(0)
    model = qwen2.Model(qwen2.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    index = {"metadata": {}, "weight_map": dict.fromkeys(weights, "model.safetensors")}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return str(out)


async def _twice(url: str) -> list[tuple[str, int]]:
    """The same greedy turn twice (the second from the first's cached KV)."""
    said = []
    async with openai_client(url) as client:
        for _ in range(2):
            r = await client.responses.create(
                model="q2", input="Hello there", max_output_tokens=24, temperature=0
            )
            said.append((r.output_text, r.usage.input_tokens_details.cached_tokens))
    return said


async def test_pipeline_sharding_answers_as_one_rank_does(
    tmp_path: Path, pipeline_model: str
) -> None:
    """Consecutive layers per rank: rank 1 runs the first half, rank 0 the
    rest, and each caches its own layers' KV."""
    async with trio.open_nursery() as nursery:
        solo = await start_server(nursery, model=pipeline_model, model_name="q2")
        expected = await _twice(solo.url)
        nursery.cancel_scope.cancel()
    args = ("--model", pipeline_model, "--model-name", "q2", "--sharding", "pipeline")
    async with launch_ranks(tmp_path, *args, "--data-dir", str(tmp_path / "d")) as ranks:
        await ranks.wait_ready()
        got = await _twice(ranks.url)
    assert [text for text, _ in got] == [text for text, _ in expected]
    assert got[0][0] and got[1][1] > 0  # the second turn reused the first's KV


async def test_ranks_that_cannot_shard_the_model_say_so(tmp_path: Path) -> None:
    """mlx-lm has no pipeline sharding for qwen3 (the embedded model's
    family): every rank fails to open it, and rank 0 exits with the reason."""
    async with launch_ranks(
        tmp_path, "--sharding", "pipeline", "--data-dir", str(tmp_path / "d")
    ) as ranks:
        status = await ranks.wait_exit(0, timeout=60)
        log = ranks.log(0)
    assert status == 1
    assert "could not open the model on every rank" in log, log[-2000:]
    assert "does not support pipelining" in log


class _ScriptedLink:
    """A Link whose sums are given (rank 0 of two): what the other rank said."""

    def __init__(self, other: list[int]) -> None:
        from mlxtrio.engine.distributed.world import World

        self.world = World(0, 2)
        self._other = other

    def sum_ints(self, values: list[int]) -> list[int]:
        return [v + o for v, o in zip(values, [0, 0, 0, 0, 0, *self._other], strict=True)]

    def broadcast(self, payload: bytes | None, size: int) -> bytes:
        return payload or b""


def test_rank_0_ends_the_world_when_a_rank_is_out_of_step() -> None:
    """Every rank reports its state before the round's commands; a rank whose
    batch parted from rank 0's (a failure only it met) is caught at once."""
    import queue

    from mlxtrio.engine.distributed.doorbell import Doorbell
    from mlxtrio.engine.distributed.lockstep import LeaderSchedule, RankDivergence

    def before() -> tuple[int, int, int]:
        return (1, 40, 2)

    in_step = LeaderSchedule(queue.SimpleQueue(), _ScriptedLink([1, 40, 2]), Doorbell())  # type: ignore[arg-type]
    in_step.commands(False, before)
    assert in_step.agree([], 16, before) == 16
    assert [(r.live, r.steps) for r in in_step.ranks] == [(1, 40), (1, 40)]
    parted = LeaderSchedule(queue.SimpleQueue(), _ScriptedLink([0, 40, 2]), Doorbell())  # type: ignore[arg-type]
    parted.commands(False, before)
    with pytest.raises(RankDivergence, match="rank 1 is out of step"):
        parted.agree([], 16, before)
