package target

// asynq: a task hash, LPUSH pending or ZADD scheduled (relay/asynq.go).
func init() {
	Register(Spec{
		Name:        "asynq",
		Order:       2,
		Help:        "asynq",
		FixedKeys:   "must be empty with the asynq target: asynq's key names are fixed, and its servers would never see namespaced tasks",
		Length:      "LLEN",
		TraceSystem: "asynq",
		Goldens:     []string{"asynq_task.json", "asynq_task_scheduled_unique.json", "asynq_task_tenant.json"},
	})
}
