#!/bin/bash
cat > /app/service.ini <<'EOF'
[server]
port = 8080

[database]
name = gyre

[logging]
level = debug
EOF
