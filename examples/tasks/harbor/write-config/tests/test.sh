#!/bin/bash
# One named score per section: partial credit for a partly right file. The script's own shell writes the
# reward (a program it runs may not: Gyre runs each under Landlock, since it may run the agent's code).
python3 - > /logs/verifier/reward.json <<'EOF'
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
print(json.dumps(scores))
EOF
