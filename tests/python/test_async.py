"""The *_async calls on a real event loop: a trainer (this process) and a TP-2 replica of two rollout
processes whose resume hooks take RESUME_DELAY_S, so that finishing an update takes that long. A
ticker coroutine runs beside every await and records when it ran: the loop was never blocked if the
ticks kept coming while the update was finishing. Every rank's storage is checked bit for bit."""

import asyncio
import time

import numpy as np
import pytest

import ferry
import reference
from test_update import CONFIG, REF_CONFIG, TIMEOUT_S, TP, Rank, check_rank_storage, make_weights

RESUME_DELAY_S = 0.5
TICK_S = 0.005


def SlowRank(address, rank, out):  # noqa: N802 (Rank's, with --resume-delay-s)
    return Rank(address, rank, out, "--resume-delay-s", str(RESUME_DELAY_S))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    trainer = ferry.Trainer()
    ranks = [SlowRank(trainer.coordinator_address, r, out) for r in range(TP)]
    try:
        for r in ranks:
            r.expect("ready")
        asyncio.run(trainer.wait_for_ranks_async(TP, timeout_ms=TIMEOUT_S * 1000))
        yield trainer, ranks, out
    finally:
        trainer.close()
        for r in ranks:
            r.wait()


class Ticker:
    """Ticks every TICK_S on the loop, recording when; gaps() are the pauses between ticks in a window."""

    def __init__(self):
        self.times = []
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self):
        while True:
            self.times.append(time.monotonic())
            await asyncio.sleep(TICK_S)

    def ticks_between(self, start, end):
        return [t for t in self.times if start <= t <= end]

    async def stop(self):
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task


def test_finish_awaited_while_the_loop_keeps_ticking(cluster):
    trainer, ranks, out = cluster
    manifest = ferry.llama_manifest(ferry.LlamaConfig(**CONFIG))

    async def main():
        ticker = Ticker()
        reports = []
        for version in (1, 2):
            weights = make_weights(manifest, seed=version)
            await trainer.start_weight_update_async(version, manifest)
            if version == 1:
                await trainer.update_weights_async(weights)
            else:
                for name, tensor in weights.items():
                    await trainer.send_async(name, tensor)
            start = time.monotonic()
            report = await trainer.finish_weight_update_async()
            end = time.monotonic()
            reports.append((report, weights, start, end))
        await ticker.stop()
        return ticker, reports

    ticker, reports = asyncio.run(main())
    for version, (report, weights, start, end) in zip((1, 2), reports):
        assert isinstance(report, ferry.UpdateReport)
        assert report.version == version and report.ranks == TP and report.moved == 0
        # The finish waited for the resume hooks: it took a while, and the loop ticked all along.
        assert end - start >= RESUME_DELAY_S * 0.9
        ticks = ticker.ticks_between(start, end)
        assert len(ticks) >= 10, f"v{version}: {len(ticks)} ticks in {end - start:.2f} s of finish"
        gaps = np.diff([start] + ticks + [end])
        assert gaps.max() < RESUME_DELAY_S / 2, f"v{version}: the loop stood still {gaps.max():.3f} s"
        for r, rank in enumerate(ranks):
            rank.expect("paused", version, "abort", True)
            rank.expect("resumed", version)
            check_rank_storage(out, version, r, weights)


def test_errors_come_out_of_the_await(cluster):
    trainer, ranks, out = cluster
    manifest = ferry.llama_manifest(ferry.LlamaConfig(**CONFIG))
    bad = [(t.name, t.dtype, [t.shape[0] + 1] + t.shape[1:]) if t.name == "model.norm.weight" else t for t in manifest]
    weights = make_weights(manifest, seed=4)

    async def main():
        ticker = Ticker()
        with pytest.raises(ferry.Error) as e:
            await trainer.start_weight_update_async(3, bad)
        assert e.value.code == "InvalidArgument" and "model.norm.weight" in e.value.message
        with pytest.raises(ferry.Error) as e:
            await trainer.abort_weight_update_async()  # no update is open
        start = time.monotonic()
        with pytest.raises(ferry.Error) as e:
            await trainer.wait_for_ranks_async(TP + 1, timeout_ms=300)
        assert e.value.code == "DeadlineExceeded"
        assert len(ticker.ticks_between(start, time.monotonic())) >= 5
        # A failed send; the finish raises; an update aborted by the trainer; then one lands.
        await trainer.start_weight_update_async(4, manifest)
        with pytest.raises(ferry.Error) as e:
            await trainer.send_async("model.norm.weight", weights["model.norm.weight"][:-1])
        assert e.value.code == "InvalidArgument"
        with pytest.raises(ferry.Error):
            await trainer.finish_weight_update_async()
        await trainer.start_weight_update_async(5, manifest)
        await trainer.abort_weight_update_async("the trainer changed its mind")
        await trainer.start_weight_update_async(6, manifest)
        await trainer.update_weights_async(weights)
        report = await trainer.finish_weight_update_async()
        await ticker.stop()
        return report

    report = asyncio.run(main())
    assert report.version == 6
    for r, rank in enumerate(ranks):
        while True:  # the failed and aborted updates' lines, then v6's resume
            words = rank.lines.get(timeout=TIMEOUT_S)
            assert words[0] != "eof"
            if words == ["resumed", "6"]:
                break
        check_rank_storage(out, 6, r, weights)


NUMPY_DTYPES = {"bf16": np.uint16, "f8_e4m3fn": np.uint8, "f32": np.float32}


def test_rollout_worker_serves_on_the_loop():
    """A rollout rank in this process, serving with serve_async() on the same loop as the trainer."""
    cfg = ferry.LlamaConfig(**CONFIG)
    spec = ferry.llama_rank_spec(cfg, 0, 1, "fp8_per_tensor")
    layout = ferry.storage_tensors(spec)
    arrays = {t.name: np.zeros(t.shape, NUMPY_DTYPES[t.dtype]) for t in layout}
    storage = ferry.ModelStorage.wrap(spec, {t.name: ferry.view_as(arrays[t.name], t.dtype) for t in layout})
    manifest = ferry.llama_manifest(cfg)
    weights = make_weights(manifest, seed=7)
    events = []

    def resume(version):
        time.sleep(RESUME_DELAY_S)  # on ferry's thread, with the GIL let go: the loop goes on
        events.append(("resumed", version))

    async def main():
        ticker = Ticker()
        trainer = ferry.Trainer()
        worker = ferry.RolloutWorker(spec, storage, pause=lambda r: events.append(("paused", r.version)),
                                     resume=resume, coordinator=trainer.coordinator_address)
        serving = asyncio.ensure_future(worker.serve_async())
        await trainer.wait_for_ranks_async(1, timeout_ms=TIMEOUT_S * 1000)
        with pytest.raises(ferry.Error) as e:
            await worker.wait_closed_async(50)  # the coordinator is still there
        assert e.value.code == "DeadlineExceeded"
        await trainer.start_weight_update_async(7, manifest)
        await trainer.update_weights_async(weights)
        start = time.monotonic()
        report = await trainer.finish_weight_update_async()
        end = time.monotonic()
        await worker.wait_serving_async(TIMEOUT_S * 1000)
        assert worker.weight_version == 7 and worker.consistent and not worker.paused
        assert not serving.done()
        trainer.close()  # the job ends: serve_async returns
        await asyncio.wait_for(serving, TIMEOUT_S)
        with pytest.raises(ferry.Error) as e:
            await trainer.finish_weight_update_async()  # closed
        assert e.value.code == "FailedPrecondition"
        worker.close()
        await ticker.stop()
        return report, ticker.ticks_between(start, end), end - start

    report, ticks, seconds = asyncio.run(main())
    assert report.version == 7 and report.ranks == 1
    assert seconds >= RESUME_DELAY_S * 0.9 and len(ticks) >= 10
    assert events == [("paused", 7), ("resumed", 7)]
    want = reference.expected_storage(REF_CONFIG, weights, 0, 1)
    assert sorted(want) == sorted(arrays)
    for name, w in want.items():
        assert arrays[name].view(np.uint8).tobytes() == w.view(np.uint8).tobytes(), name


def test_serve_async_can_be_cancelled():
    cfg = ferry.LlamaConfig(**CONFIG)
    spec = ferry.llama_rank_spec(cfg, 0, 1, "fp8_per_tensor")
    layout = ferry.storage_tensors(spec)
    arrays = {t.name: np.zeros(t.shape, NUMPY_DTYPES[t.dtype]) for t in layout}
    storage = ferry.ModelStorage.wrap(spec, {t.name: ferry.view_as(arrays[t.name], t.dtype) for t in layout})

    async def main():
        with ferry.Trainer() as trainer:
            with ferry.RolloutWorker(spec, storage, coordinator=trainer.coordinator_address) as worker:
                serving = asyncio.ensure_future(worker.serve_async())
                await asyncio.sleep(0.3)
                serving.cancel()
                start = time.monotonic()
                with pytest.raises(asyncio.CancelledError):
                    await serving
                with pytest.raises(ferry.Error) as e:
                    await worker.serve_async(timeout_ms=250)
                assert e.value.code == "DeadlineExceeded"
            # closed on leaving the block (after the slice still running): calls raise at once
            with pytest.raises(ferry.Error) as e:
                await worker.wait_serving_async(10)
            assert e.value.code == "FailedPrecondition"
            return time.monotonic() - start

    assert asyncio.run(main()) < 5


def test_async_methods_keep_the_classes():
    assert issubclass(ferry.Trainer, ferry._ferry.Trainer)
    assert issubclass(ferry.RolloutWorker, ferry._ferry.RolloutWorker)
    for cls, names in ((ferry.Trainer, ["wait_for_ranks", "start_weight_update", "send", "update_weights",
                                        "finish_weight_update", "abort_weight_update"]),
                       (ferry.RolloutWorker, ["wait_serving", "wait_closed", "serve", "resume"])):
        for name in names:
            assert asyncio.iscoroutinefunction(getattr(cls, name + "_async")), name
