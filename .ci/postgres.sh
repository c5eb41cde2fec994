#!/usr/bin/env bash
# Start a throwaway PostgreSQL server (Debian's package) on loopback for the DB tests and
# print the SQLAlchemy URL they take from TUNER_TEST_POSTGRES_URL. Idempotent.
set -euo pipefail
if ! command -v pg_ctlcluster >/dev/null 2>&1 || ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  (apt-get install -y -q postgresql >/dev/null 2>&1) || (apt-get update -q >/dev/null && apt-get install -y -q postgresql >/dev/null)
fi
version=$(ls /usr/lib/postgresql | sort -V | tail -n 1)
if ! pg_lsclusters -h | awk '{print $1" "$2}' | grep -qx "$version main"; then
  pg_createcluster "$version" main >/dev/null
fi
pg_ctlcluster "$version" main start >/dev/null 2>&1 || true  # already running is fine
port=$(pg_lsclusters -h | awk -v v="$version" '$1==v && $2=="main" {print $3}')
for _ in $(seq 50); do
  su postgres -c "psql -p $port -qtAc 'select 1'" >/dev/null 2>&1 && break
  sleep 0.2
done
su postgres -c "psql -p $port -qtAc \"DO \\\$\\\$BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname='tuner_test') THEN CREATE ROLE tuner_test LOGIN SUPERUSER PASSWORD 'tuner_test'; END IF; END\\\$\\\$;\"" >/dev/null
su postgres -c "psql -p $port -qtAc \"SELECT 1 FROM pg_database WHERE datname='tuner_test'\"" | grep -q 1 \
  || su postgres -c "createdb -p $port -O tuner_test tuner_test"
echo "postgresql+psycopg://tuner_test:tuner_test@127.0.0.1:$port/tuner_test"
