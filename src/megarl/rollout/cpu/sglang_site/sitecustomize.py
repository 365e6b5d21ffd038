"""Run by Python at start in a real SGLang server on the CPU (this folder is on the server's PYTHONPATH
only: `megarl.rollout.launch.sglang_server_env`).

SGLang imports torchvision; PyPI's torchvision is built against CUDA torch, so under the CPU build of torch
its `_C` extension does not load and `torchvision/_meta_registrations.py` fails at import on
`register_fake("torchvision::nms")`, an op its extension would have defined. Defining the two op schemas
it registers fakes for (`nms`, `qnms`, as torchvision's `csrc/ops/nms.cpp` declares them) lets it import;
SGLang never calls them for a language model. Only where torch has no CUDA: a CUDA torch loads
torchvision's extension itself.
"""
import torch

if torch.version.cuda is None:
    _torchvision_ops = torch.library.Library("torchvision", "DEF")
    _torchvision_ops.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _torchvision_ops.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
