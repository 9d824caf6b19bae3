.PHONY: test lint demo bench
test:
	bash .ci/run
lint:
	ruff check catalog tabloader tests examples && ruff format --check catalog tabloader tests examples && mypy --strict catalog tabloader
demo:
	tabloader demo
bench:
	tabloader bench catalog && tabloader bench sampling && tabloader bench e2e
