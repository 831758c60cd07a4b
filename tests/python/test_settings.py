"""Every setting as a keyword of ferry.Trainer / ferry.RolloutWorker (the FERRY_* name lower-cased
without FERRY_): a keyword beats the environment, each value reports where it came from, an unknown
keyword is a TypeError naming it, and an update runs with the keywords' transport, buckets, token."""

import numpy as np
import pytest

import ferry

CFG = dict(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=128, num_layers=1, dtype="f32")


def test_keyword_beats_environment_and_sources_are_reported(monkeypatch):
    monkeypatch.setenv("FERRY_BUCKET_BYTES", "8K")
    monkeypatch.setenv("FERRY_TIMEOUT_MS", "5000")
    monkeypatch.setenv("FERRY_TRANSPORT", "carrier-pigeon")  # malformed; the keyword replaces it unread
    monkeypatch.delenv("FERRY_VERIFY", raising=False)
    s = ferry.settings(bucket_bytes="64M", transport="tcp", verify=True, buckets_in_flight=2)
    assert s["bucket_bytes"] == (64 << 20, "keyword")
    assert s["transport"] == ("tcp", "keyword")
    assert s["verify"] == (True, "keyword")
    assert s["buckets_in_flight"] == (2, "keyword")
    assert s["timeout_ms"] == (5000, "environment")
    assert s["listen_host"] == ("127.0.0.1", "default")
    assert set(s) >= {"log_level", "coordinator", "max_staging_bytes", "rollback", "token", "metrics_port"}
    with ferry.Trainer(timeout_ms=20000, bucket_bytes="64M", transport="tcp") as trainer:
        assert trainer.settings["timeout_ms"] == (20000, "keyword")
        assert trainer.settings["bucket_bytes"] == (64 << 20, "keyword")
    with pytest.raises(ferry.Error) as e:
        ferry.Trainer()  # the environment's malformed FERRY_TRANSPORT, named
    assert "FERRY_TRANSPORT='carrier-pigeon'" in e.value.message


def test_unknown_or_malformed_keywords_are_named():
    with pytest.raises(TypeError, match="'bucket_byte'.*bucket_bytes"):
        ferry.Trainer(bucket_byte="64M")
    with pytest.raises(TypeError, match="'timeout'"):
        ferry.settings(timeout=5)
    with pytest.raises(TypeError, match="timeout_ms"):
        ferry.settings(timeout_ms=1.5)
    with pytest.raises(ferry.Error) as e:
        ferry.Trainer(timeout_ms="soon")
    assert e.value.code == "InvalidArgument" and "timeout_ms='soon'" in e.value.message
    with pytest.raises(ferry.Error) as e:
        ferry.settings(bucket_bytes=1024)
    assert "bucket_bytes='1024'" in e.value.message


def test_update_with_keyword_settings(monkeypatch):
    monkeypatch.setenv("FERRY_TOKEN", "from-the-environment")
    monkeypatch.setenv("FERRY_BUCKET_BYTES", "not-a-size")
    cfg = ferry.LlamaConfig(**CFG)
    manifest = ferry.llama_manifest(cfg)
    rng = np.random.default_rng(1)
    weights = {t.name: rng.normal(0, 0.1, size=tuple(t.shape)).astype(np.float32) for t in manifest}
    keywords = dict(token="s3cret", transport="tcp", bucket_bytes="8K", timeout_ms=20000)
    with ferry.Trainer(**keywords) as trainer:
        spec = ferry.llama_rank_spec(cfg, 0, 1, "none")
        storage = ferry.ModelStorage.allocate(spec, "cpu", none_dtype="f32")
        with pytest.raises(ferry.Error) as e:  # the embedded coordinator wants the keyword's token
            ferry.RolloutWorker(spec, storage, coordinator=trainer.coordinator_address,
                                **dict(keywords, token="wrong"))
        assert e.value.code == "Unauthenticated"
        with ferry.RolloutWorker(spec, storage, coordinator=trainer.coordinator_address, **keywords) as worker:
            assert worker.settings["coordinator"] == (trainer.coordinator_address, "keyword")
            assert worker.settings["token"] == ("(set)", "keyword")
            trainer.wait_for_ranks(1, 20000)
            trainer.start_weight_update(1, manifest)
            trainer.update_weights(weights)
            report = trainer.finish_weight_update()
            assert report.moved == 0 and worker.weight_version == 1
            assert report.bytes > 8192 * 4
            name = "model.layers.0.mlp.down_proj.weight"
            assert np.array_equal(np.from_dlpack(storage.get(name)), weights[name])
