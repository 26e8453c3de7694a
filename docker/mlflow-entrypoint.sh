#!/bin/sh
# Start the MLflow server with basic auth, refusing the default admin password; secrets come from the environment.
set -eu
: "${MLFLOW_AUTH_ADMIN_PASSWORD:?set MLFLOW_AUTH_ADMIN_PASSWORD in docker/.env}"
: "${MLFLOW_FLASK_SERVER_SECRET_KEY:?set MLFLOW_FLASK_SERVER_SECRET_KEY in docker/.env}"
if [ "$MLFLOW_AUTH_ADMIN_PASSWORD" = "password1234" ]; then
  echo "refusing MLflow's default admin password; set MLFLOW_AUTH_ADMIN_PASSWORD" >&2
  exit 1
fi
mkdir -p /var/lib/mlflow-auth
sed "s/^admin_password = .*/admin_password = ${MLFLOW_AUTH_ADMIN_PASSWORD}/" /etc/lmforge/mlflow-auth.ini > /var/lib/mlflow-auth/auth.ini
export MLFLOW_AUTH_CONFIG_PATH=/var/lib/mlflow-auth/auth.ini
exec mlflow server \
  --app-name basic-auth \
  --backend-store-uri "postgresql+psycopg2://${POSTGRES_USER}:${POSTGRES_PASSWORD}@postgres:5432/mlflow" \
  --artifacts-destination "s3://${LMFORGE_BUCKET}/mlflow" \
  --host 0.0.0.0 --port 5000
