#!/bin/bash
# One named score per section: partial credit for a partly right file.
python3 - <<'EOF'
import configparser, json, os
cfg = configparser.ConfigParser()
try:
    cfg.read("/app/service.ini")
except configparser.Error:
    pass
def has(section, key, value):
    return float(cfg.has_section(section) and cfg.get(section, key, fallback=None) == value)
scores = {"server": has("server", "port", "8080"),
          "database": has("database", "name", os.environ["EXPECTED_DB"]),
          "logging": has("logging", "level", "debug")}
json.dump(scores, open("/logs/verifier/reward.json", "w"))
EOF
