"""launch/log.py: rank 0 shows INFO, other ranks warnings, --verbose everything, --log-dir writes every
rank's full log; a debug record no handler writes is never made."""

from __future__ import annotations

import logging

import pytest

from hetero_run.launch.log import LOGGER_NAME, setup_logging


@pytest.fixture(autouse=True)
def _restore():
    logger = logging.getLogger(LOGGER_NAME)
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    yield
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    for handler in handlers:
        logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = propagate


def test_debug_records_are_made_only_when_a_handler_writes_them(tmp_path):
    log = logging.getLogger(f"{LOGGER_NAME}.runtime.engine")
    setup_logging(0)
    assert log.isEnabledFor(logging.INFO) and not log.isEnabledFor(logging.DEBUG)
    setup_logging(1)
    assert log.isEnabledFor(logging.WARNING) and not log.isEnabledFor(logging.INFO)
    setup_logging(1, verbose=True)
    assert log.isEnabledFor(logging.DEBUG)

    setup_logging(1, log_dir=tmp_path)  # the file takes everything, the console warnings only
    assert log.isEnabledFor(logging.DEBUG)
    log.debug("step %d planned", 7)
    for handler in logging.getLogger(LOGGER_NAME).handlers:
        handler.flush()
    text = (tmp_path / "rank1.log").read_text()
    assert "DEBUG [rank 1] hetero_run.runtime.engine: step 7 planned" in text
