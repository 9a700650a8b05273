package target

// Celery (task protocol 2, Kombu's Redis transport): LPUSH of a message
// envelope (relay/celery.go). Celery on Redis holds an eta in memory:
// jobs are claimed once due.
func init() {
	Register(Spec{
		Name:        "celery",
		Order:       5,
		Help:        "celery (Celery task protocol 2)",
		DueOnly:     true,
		NoCluster:   "Kombu's Redis transport, which Celery's workers read with, does not support Redis Cluster (use a single Redis or Sentinel)",
		Length:      "LLEN",
		TraceSystem: "celery",
		Goldens:     []string{"celery_task.json", "celery_task_namespace_tenant.json"},
	})
}
