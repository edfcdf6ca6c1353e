"""Check that the data gives image samples, for models that convolve.

Why: the sample shape comes from the data module at runtime, so pairing a conv model with a
vector dataset (model=cnn data=synthetic) is a config mistake that deserves a ValueError naming
both choices, not a shape error deep inside the first forward pass.
"""

from collections.abc import Sequence


def image_shape(model_name: str, input_shape: Sequence[int]) -> tuple[int, int, int]:
    """Return input_shape as (C, H, W), or raise ValueError if it is not 3-D."""
    shape = tuple(int(s) for s in input_shape)
    if len(shape) != 3:
        raise ValueError(
            f"model={model_name} needs image inputs (C, H, W) but the data gives samples of "
            f"shape {shape}; use data=fake, data=mnist or data=cifar10"
        )
    channels, height, width = shape
    return channels, height, width
