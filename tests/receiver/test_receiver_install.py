"""A prefill node installs the receiver without the server's model stack: it imports, encodes through
a real server, serves precomputed items and loads encoder-precompute's files in a process where
transformers, pillow and tqdm cannot load."""

from __future__ import annotations

import asyncio
import json
import sys

from precompute.command import main as precompute_main
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
from receiver.embeddings.precomputed_files import precomputed_item

async def main(url, image_path, cache_dir):
    image = open(image_path, "rb").read()
    async with EncoderReceiver([url]) as rx:
        raw = (await rx.encode("raw", [{"modality": "image", "data": image}])).items[0]
        precomputed = {"modality": "image", "precomputed_embedding": raw.embedding, "grid_thw": raw.grid_thw}
        only = await rx.encode("precomputed-only", [precomputed, dict(precomputed)])
        mixed = await rx.encode("mixed", [precomputed, {"modality": "image", "data": image}])
        # encoder-precompute's file for this image (written by the parent), and a miss that stays raw
        from_file = await rx.encode("from-file", [precomputed_item(cache_dir, image)])
    return {
        "equal": all(item.embedding.equal(raw.embedding) for item in [*only.items, *mixed.items]),
        "precomputed": [item.precomputed for item in [*only.items, *mixed.items]],
        "from_file": from_file.items[0].precomputed and from_file.items[0].embedding.equal(raw.embedding),
        "miss_is_raw": precomputed_item(cache_dir, b"not cached") == {"modality": "image", "data": b"not cached"},
        "loaded": sorted(name for name in BLOCKED if name in sys.modules),
    }

print(json.dumps(asyncio.run(main(*sys.argv[1:4]))))
"""


async def test_receiver_imports_encodes_and_loads_precomputed_files_without_the_server_extra(
    default_model_dir, tmp_path
):
    image = tmp_path / "image.png"
    image.write_bytes(image_bytes(56, 56, seed=3))
    cache_dir = tmp_path / "precomputed"
    async with running_server(default_model_dir) as server:
        argv = ["--encoder-url", server.url, "--out", str(cache_dir), "--no-progress", str(image)]
        assert await asyncio.to_thread(precompute_main, argv) == 0
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", RECEIVER_ONLY, server.url, str(image), str(cache_dir),
            cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(child.communicate(), timeout=120)
    assert child.returncode == 0, err.decode()
    report = json.loads(out)
    assert report == {
        "equal": True,
        "precomputed": [True, True, True, False],
        "from_file": True,
        "miss_is_raw": True,
        "loaded": [],
    }
