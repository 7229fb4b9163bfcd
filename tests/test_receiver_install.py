"""A prefill node installs the receiver without the server's model stack: it imports, encodes through
a real server and serves precomputed items in a process where transformers and pillow cannot load."""

from __future__ import annotations

import asyncio
import json
import sys

from testkit import REPO_ROOT
from testkit.images import image_bytes
from testkit.servers import running_server

# Runs in a child interpreter whose import system refuses the server extra's packages.
RECEIVER_ONLY = r"""
import asyncio, importlib.abc, json, sys

BLOCKED = {"transformers", "PIL", "tqdm", "grpc_reflection", "encoder_server", "testkit"}

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (not installed on a prefill node)", name=name)
        return None

sys.meta_path.insert(0, Refuse())

from receiver import EncoderReceiver

async def main(url, image_path):
    image = open(image_path, "rb").read()
    async with EncoderReceiver([url]) as rx:
        raw = (await rx.encode("raw", [{"modality": "image", "data": image}])).items[0]
        precomputed = {"modality": "image", "precomputed_embedding": raw.embedding, "grid_thw": raw.grid_thw}
        only = await rx.encode("precomputed-only", [precomputed, dict(precomputed)])
        mixed = await rx.encode("mixed", [precomputed, {"modality": "image", "data": image}])
    return {
        "equal": all(item.embedding.equal(raw.embedding) for item in [*only.items, *mixed.items]),
        "precomputed": [item.precomputed for item in [*only.items, *mixed.items]],
        "loaded": sorted(name for name in BLOCKED if name in sys.modules),
    }

print(json.dumps(asyncio.run(main(*sys.argv[1:3]))))
"""


async def test_receiver_imports_and_encodes_without_transformers_or_pillow(default_model_dir, tmp_path):
    image = tmp_path / "image.png"
    image.write_bytes(image_bytes(56, 56, seed=3))
    async with running_server(default_model_dir) as server:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", RECEIVER_ONLY, server.url, str(image),
            cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(child.communicate(), timeout=120)
    assert child.returncode == 0, err.decode()
    report = json.loads(out)
    assert report == {"equal": True, "precomputed": [True, True, True, False], "loaded": []}
