# Two entry points that work on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint clean browser ceph etcd

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch is pinned and installed first: 2.13.0 is the CPU build on disk; an unpinned torch would
# resolve to a multi-GB CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/meshplan demo

# The browser test drives Debian's Chromium: installed here when missing and apt-get can (as
# root); otherwise tests/apps/test_browser.py skips and says why.
browser:
	@if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		echo "installing Debian's chromium for the browser test"; \
		(apt-get update -qq && apt-get install -y -qq chromium >/dev/null) \
			|| echo "chromium could not be installed: tests/apps/test_browser.py will skip"; \
	fi

# The object-store checkpoint test starts Debian's radosgw on a one-node Ceph (runtime/radosgw.py):
# installed here when missing and apt-get can (as root); otherwise
# tests/runtime/test_object_store_checkpoint.py skips and says why.
CEPH_PACKAGES := ceph-mon ceph-osd radosgw ceph-common
ceph:
	@if ! (command -v ceph-mon && command -v ceph-osd && command -v radosgw && \
		command -v radosgw-admin) >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		echo "installing Debian's $(CEPH_PACKAGES) for the object-store test"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			$(CEPH_PACKAGES) >/dev/null) \
			|| echo "Ceph could not be installed: tests/runtime/test_object_store_checkpoint.py will skip"; \
	fi

# The elastic-launch test starts Debian's etcd-server (the v2 API of torchrun's etcd-v2
# rendezvous): installed here when missing and apt-get can (as root); otherwise
# tests/runtime/test_elastic_launch.py skips and says why.
etcd:
	@if ! command -v etcd >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		echo "installing Debian's etcd-server for the elastic-launch test"; \
		(apt-get update -qq && apt-get install -y -qq etcd-server >/dev/null) \
			|| echo "etcd-server could not be installed: tests/runtime/test_elastic_launch.py will skip"; \
	fi

test: $(STAMP) browser ceph etcd
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) runs .pytest_cache
