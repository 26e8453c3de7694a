-- Two databases on one PostgreSQL server: MLflow's backend store and Prefect's database (needs pg_trgm).
CREATE DATABASE mlflow;
CREATE DATABASE prefect;
\connect prefect
CREATE EXTENSION IF NOT EXISTS pg_trgm;
