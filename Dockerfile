# The opledger workers, for docker-compose.yml. Not used by the local launcher or CI.
FROM python:3.11.7-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY kafka kafka
COPY ledger ledger
COPY producers producers
COPY processors processors
COPY projections projections
COPY consumers consumers
COPY opledger opledger
RUN pip install --no-cache-dir . && useradd --system --no-create-home opledger
USER opledger
ENTRYPOINT []
CMD ["opledger", "projector", "run"]
