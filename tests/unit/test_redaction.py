"""Secrets in URLs (credentials, query values, fragments) never reach logs, failure records or provenance."""

import json

from megatron_osprey.base.provenance import write_provenance
from megatron_osprey.base.redact import redact_urls
from megatron_osprey.data.regenerate.backends import JOB_API_KEY_ENV, redact_credentials, server_api_key


def test_query_values_and_fragments_are_redacted_and_parameter_names_kept():
    text = "POST http://host:9/?token=SECRET&x=1;sig=ABC#frag-SECRET failed; then https://u:pw@h/v1?key failed"
    assert redact_urls(text) == (
        "POST http://host:9/?token=***&x=***;sig=***#*** failed; then https://***@h/v1?*** failed"
    )
    assert redact_credentials("'http://a:b@h:1/v1?api_key=K'") == "'http://***@h:1/v1?api_key=***'"
    assert redact_urls("no url, a path /tmp/a?b=c stays") == "no url, a path /tmp/a?b=c stays"


def test_provenance_keeps_no_url_secret(tmp_path):
    command = ["regenerate", "--server-url", "http://host:9/?token=SECRET"]
    config = {"server_url": ["http://alice:pw@host:9/v1#SECRET"]}
    path = write_provenance(tmp_path, "regenerate", {}, {}, config=config, command=command)
    text = path.read_text()
    assert "SECRET" not in text and "alice" not in text and "pw@" not in text
    assert json.loads(text)["command"][2] == "http://host:9/?token=***"


def test_the_job_key_is_the_default_bearer_key_and_an_explicit_variable_wins():
    env = {JOB_API_KEY_ENV: "job-key", "OPENAI_API_KEY": "openai-key", "MINE": "mine"}
    assert JOB_API_KEY_ENV == "OSPREY_SERVER_API_KEY"
    assert server_api_key(None, env) == "job-key"
    assert server_api_key("MINE", env) == "mine"
    assert server_api_key(None, {"OPENAI_API_KEY": "openai-key"}) == "openai-key"
    assert server_api_key(None, {}) is None


def test_log_lines_of_any_logger_carry_no_url_secret_or_key():
    """What httpx logs at INFO (the request URL), a traceback holding a URL, and a header line with the key."""
    import io
    import logging

    from megatron_osprey.base.redact import RedactingFormatter

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(RedactingFormatter("%(name)s %(message)s", secrets=("sk-KEY-31",)))
    logger = logging.getLogger("httpx")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        logger.info('HTTP Request: GET %s "HTTP/1.1 200 OK"', "http://u:pw@127.0.0.1:9/v1/models?token=SECRET#FRAG")
        try:
            raise ConnectionError("cannot reach https://gw/v1?sig=SECRET")
        except ConnectionError:
            logger.exception("request failed")
        logger.setLevel(logging.DEBUG)
        logger.debug("headers: Authorization: Bearer sk-OTHER-1 key=sk-KEY-31")
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
        logger.setLevel(logging.NOTSET)
    text = stream.getvalue()
    assert 'httpx HTTP Request: GET http://***@127.0.0.1:9/v1/models?token=***#*** "HTTP/1.1 200 OK"' in text
    assert "https://gw/v1?sig=***" in text and "Traceback" in text
    assert "Authorization: Bearer *** key=***" in text
    assert all(s not in text for s in ("SECRET", "FRAG", "pw@", "sk-OTHER", "sk-KEY"))
