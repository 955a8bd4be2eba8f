"""The GPU half: the CUDA route checked without a GPU (toolchain, driver stub, the
FlashInfer JIT probe), the cases each GPU kind must run, the nightly job, and the bundle
for an air-gapped GPU host.
"""
