"""`titan-lora serve` refuses a config it cannot serve, one line per mistake, before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from titan_lora.cli import main

SHIPPED = Path(__file__).resolve().parents[2] / "train_configs/smollm2_service.toml"


def test_the_shipped_service_config_checks_clean() -> None:
    assert main(["check", str(SHIPPED)]) == 0


def test_serve_refuses_no_keys_and_a_bad_key(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("TITAN_LORA_API_KEYS", raising=False)
    config = tmp_path / "service.toml"
    config.write_text(SHIPPED.read_text().replace('api_keys = ["tml-local-dev"]', "api_keys = []"))
    assert main(["serve", str(config)]) == 2
    assert ("titan_lora: config error: [service] api_keys is empty: set at least one key (\"tml-...\"), or "
            "export TITAN_LORA_API_KEYS") in capsys.readouterr().err
    monkeypatch.setenv("TITAN_LORA_API_KEYS", "secret-1")
    assert main(["serve", str(config), "--nproc", "2"]) == 2
    assert '[service] api_keys: secret-1... must start with "tml-"' in capsys.readouterr().err


@pytest.mark.parametrize(("override", "message"), [
    (["--service.max_adapters", "1"], "[service] max_adapters must be >= 2, got 1; a service trains at least 2"),
    (["--service.port", "70000"], "[service] port must be in [0, 65535], got 70000"),
])
def test_serve_refuses_values_out_of_range(override, message, capsys) -> None:
    assert main(["serve", str(SHIPPED), *override]) == 2
    assert message in capsys.readouterr().err
