.PHONY: test test-fast lint demo bench
test:
	bash .ci/run
test-fast:
	python -m pytest -q -n auto --maxprocesses 4 --dist loadgroup -m "not slow"
lint:
	ruff check tabloader benchmarks tests examples && ruff format --check tabloader benchmarks tests examples && mypy --strict tabloader benchmarks
demo:
	tabloader demo
bench:
	python -m benchmarks catalog && python -m benchmarks sampling && python -m benchmarks e2e
