"""The GPU-seconds per group kept by PostgreSQL as usage records are written
(``portal.prometheus.models``): the two tables, the triggers on
``scheduler_usagerecord`` and the totals of the records already there.

CREATE TRIGGER waits for the transactions writing records and holds off new ones
until this migration commits, so the totals counted here and the deltas the
triggers append afterwards cover every record exactly once.
"""

from django.db import migrations, models

TRIGGERS = """
CREATE FUNCTION prometheus_usage_delta() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND OLD.group_id = NEW.group_id THEN
        IF OLD.gpu_seconds IS DISTINCT FROM NEW.gpu_seconds THEN
            INSERT INTO prometheus_gpusecondsdelta (group_id, seconds)
            VALUES (NEW.group_id, NEW.gpu_seconds::numeric - OLD.gpu_seconds::numeric);
        END IF;
        RETURN NULL;
    END IF;
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        INSERT INTO prometheus_gpusecondsdelta (group_id, seconds)
        VALUES (OLD.group_id, -(OLD.gpu_seconds::numeric));
    END IF;
    IF TG_OP IN ('UPDATE', 'INSERT') THEN
        INSERT INTO prometheus_gpusecondsdelta (group_id, seconds)
        VALUES (NEW.group_id, NEW.gpu_seconds::numeric);
    END IF;
    RETURN NULL;
END
$$;
CREATE TRIGGER prometheus_usage_delta
    AFTER INSERT OR UPDATE OF group_id, gpu_seconds OR DELETE ON scheduler_usagerecord
    FOR EACH ROW EXECUTE FUNCTION prometheus_usage_delta();

CREATE FUNCTION prometheus_usage_truncated() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM prometheus_gpusecondsdelta;
    DELETE FROM prometheus_gpusecondstotal;
    RETURN NULL;
END
$$;
CREATE TRIGGER prometheus_usage_truncated
    AFTER TRUNCATE ON scheduler_usagerecord
    FOR EACH STATEMENT EXECUTE FUNCTION prometheus_usage_truncated();

INSERT INTO prometheus_gpusecondstotal (group_id, seconds)
SELECT group_id, sum(gpu_seconds::numeric)
FROM scheduler_usagerecord
GROUP BY group_id;
"""

DROP = """
DROP TRIGGER IF EXISTS prometheus_usage_truncated ON scheduler_usagerecord;
DROP FUNCTION IF EXISTS prometheus_usage_truncated();
DROP TRIGGER IF EXISTS prometheus_usage_delta ON scheduler_usagerecord;
DROP FUNCTION IF EXISTS prometheus_usage_delta();
"""


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        ("scheduler", "0022_job_checkpointable"),
    ]

    operations = [
        migrations.CreateModel(
            name="GpuSecondsDelta",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("group_id", models.BigIntegerField()),
                ("seconds", models.DecimalField(decimal_places=10, max_digits=40)),
            ],
        ),
        migrations.CreateModel(
            name="GpuSecondsTotal",
            fields=[
                ("group_id", models.BigIntegerField(primary_key=True, serialize=False)),
                (
                    "seconds",
                    models.DecimalField(decimal_places=10, default=0, max_digits=40),
                ),
            ],
        ),
        migrations.RunSQL(TRIGGERS, DROP),
    ]
