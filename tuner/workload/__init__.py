"""The workload tuner times and checks against: decode shapes, serving traffic, cold-L2
rotation, the reference output, and a shape's inputs."""

from tuner.workload.inputs import DecodeInputs, make_decode_inputs
from tuner.workload.reference import paged_decode_reference
from tuner.workload.shapes import DecodeShape, ShapeError, load_shapes, shape_from_dict

__all__ = ["DecodeInputs", "DecodeShape", "ShapeError", "load_shapes", "make_decode_inputs",
           "paged_decode_reference", "shape_from_dict"]
