# gpulab image: one image, several processes (compose services web, worker, beat,
# migrate, agent). Built and run only by docker-compose; `make up` needs no Docker.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    GPULAB_STATE_DIR=/var/lib/gpulab

RUN useradd --system --create-home --home-dir /home/gpulab gpulab \
    && mkdir -p /var/lib/gpulab/beat /var/lib/gpulab/agent /run/gpulab-agent \
    && chown -R gpulab:gpulab /var/lib/gpulab /run/gpulab-agent

# python-ldap (LDAP sign-in) builds from source against OpenLDAP's and SASL's headers.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev libldap2-dev libsasl2-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY . /app
RUN pip install /app

# Static files are collected into the image (whitenoise serves them). Settings need
# URLs and a key to load; none of them is contacted by collectstatic.
RUN DJANGO_SECRET_KEY=collectstatic-only \
    DATABASE_URL=postgres://build@localhost/build \
    REDIS_URL=redis://localhost:6379/0 \
    python manage.py collectstatic --noinput \
    && chown -R gpulab:gpulab /var/lib/gpulab

USER gpulab
EXPOSE 8000
CMD ["uvicorn", "portal.asgi:application", "--host", "0.0.0.0", "--port", "8000", "--ws-max-size", "2097152", "--timeout-keep-alive", "75"]
