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
