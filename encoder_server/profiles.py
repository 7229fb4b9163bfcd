"""Preprocessing profiles: whose loading and image-processor backend turn an item's bytes into pixel
values, and the engine versions each was checked against (docs/parity.md)."""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from .images import DEFAULT_MAX_IMAGE_PIXELS, ENGINE_MAX_IMAGE_PIXELS, decode_image


@dataclass(frozen=True, kw_only=True)
class PreprocessProfile:
    """One engine's way from bytes to pixel values: its image loader and the processor backend it runs."""

    name: str
    backend: str  # transformers' image-processor backend: "torchvision" or "pil"
    default_max_pixels: int  # the engine's own pixel limit, unless --max-image-pixels says otherwise
    # vLLM rescales and normalizes Qwen pixels itself, on the device, in one float32 affine step
    # (x * rescale/std - mean/std) instead of the processor's two: last-bit different values.
    fused_normalize: bool
    checked_against: tuple[str, ...]  # package versions whose own code gave the same pixel values

    def decode(self, data: bytes, *, max_pixels: int | None, max_aspect_ratio: float) -> Image.Image:
        """The RGB image this profile's engine makes of `data`; `max_pixels` None: the engine's limit."""
        limit = self.default_max_pixels if max_pixels is None else max_pixels
        return decode_image(data, loader=self.name, max_pixels=limit, max_aspect_ratio=max_aspect_ratio)


# The one table of profiles. tests/engines/test_parity.py runs the installed engines' own loaders and processors
# against these and fails when their pixel values change: update `checked_against` with the new release.
ENGINE_STACK = ("transformers 5.19.0", "torchvision 0.28.0", "pillow 13.0.0")  # in .venv-engines beside both


def _engine_profile(name: str, release: str, *, fused_normalize: bool) -> PreprocessProfile:
    """An engine's profile: its loader, the torchvision backend it runs, Pillow's refusal as its limit."""
    return PreprocessProfile(
        name=name,
        backend="torchvision",
        default_max_pixels=ENGINE_MAX_IMAGE_PIXELS,
        fused_normalize=fused_normalize,
        checked_against=(release, *ENGINE_STACK),
    )


PROFILES: dict[str, PreprocessProfile] = {
    profile.name: profile
    for profile in (
        _engine_profile("vllm", "vllm 0.32.0", fused_normalize=True),
        _engine_profile("sglang", "sglang 0.5.23", fused_normalize=False),
        PreprocessProfile(
            name="transformers",
            backend="torchvision",  # transformers' pick beside torchvision, which the server extra installs
            default_max_pixels=DEFAULT_MAX_IMAGE_PIXELS,
            fused_normalize=False,
            checked_against=("transformers 5.24.0", "torchvision 0.28.0", "pillow 13.0.0"),
        ),
    )
}
DEFAULT_PROFILE = "vllm"  # native Encode's consumers: EncoderReceiver, encoder-gateway, the vLLM connector
SGLANG_PROFILE = "sglang"  # the SglangEncoder service always follows SGLang's own encoder
