# The stored place of a waiting job becomes an order key (scheduler.queue_order):
# renamed, not dropped, so the queue keeps its order across the upgrade (the
# stored places are valid keys: they increase along the order).

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('scheduler', '0018_agent_reports'),
    ]

    operations = [
        migrations.RenameField(
            model_name='job',
            old_name='queue_position',
            new_name='queue_order',
        ),
        migrations.AlterField(
            model_name='job',
            name='queue_order',
            field=models.BigIntegerField(blank=True, null=True),
        ),
        migrations.AddIndex(
            model_name='job',
            index=models.Index(condition=models.Q(('status', 'pending')), fields=['queue_order', 'submitted_at', 'id'], name='scheduler_job_queue_idx'),
        ),
    ]
