"""Where keys are set, only an admin's key changes which models every key finds loaded: the operator's keys
(WSGI_INFER_API_KEY) and the keys-file tables that say ``admin = true``. In this process, the tiny model."""

from __future__ import annotations

from ..conftest import tiny_settings
from ..support.in_process import InProcessServer


def test_only_an_admin_key_loads_unloads_or_keeps_a_model(tiny_model_dirs, tmp_path):
    """A tenant's key unloaded the model every tenant used (a reload for the next of them), or pinned one that
    squeezed out the others', as any key could."""
    keys = tmp_path / "keys.toml"
    keys.write_text('[keys.ops]\nkey = "ops-key"\nadmin = true\n\n[keys.tenant]\nkey = "tenant-key"\n')
    with InProcessServer(tiny_settings(tiny_model_dirs, api_key="env-key", keys_file=str(keys))) as server:
        with server.client() as http:
            model = http.get("/v1/models", headers={"Authorization": "Bearer tenant-key"}).json()["data"][0]["id"]
            for key, admin in (("tenant-key", False), ("ops-key", True), ("env-key", True)):
                auth = {"Authorization": f"Bearer {key}"}
                asked = {
                    "unload": http.post(f"/v1/models/{model}/unload", headers=auth),
                    "load": http.post(f"/v1/models/{model}/load", headers=auth),
                    "keep_alive": http.post(
                        "/v1/completions", json={"prompt": "hi", "max_tokens": 1, "keep_alive": -1}, headers=auth
                    ),
                }
                for what, reply in asked.items():
                    assert reply.status_code == (200 if admin else 403), (key, what, reply.text)
                    if not admin:
                        assert reply.json()["error"]["code"] == "permission_denied"
                assert asked["unload"].json().get("state", "refused") == ("unloaded" if admin else "refused")
                plain = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=auth)
                assert plain.status_code == 200, plain.text  # every key generates
            refused = http.post("/models/unload", json={"model": model}, headers={"Authorization": "Bearer tenant-key"})
            assert refused.status_code == 403 and refused.json()["error"]["param"] is None
