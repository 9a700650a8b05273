package relay

// sidekiqKeys builds every Redis key the Sidekiq target writes. Keep them all
// here: a user's workers find jobs only if these match Sidekiq's layout.
type sidekiqKeys struct {
	prefix string // "" or "<namespace>:"
}

func newSidekiqKeys(namespace string) sidekiqKeys {
	if namespace == "" {
		return sidekiqKeys{}
	}
	return sidekiqKeys{prefix: namespace + ":"}
}

// queues is the set of queue names Sidekiq's UI and workers know about.
func (k sidekiqKeys) queues() string { return k.prefix + "queues" }

// queue is the list a queue's immediate jobs are LPUSHed to; workers BRPOP it.
func (k sidekiqKeys) queue(name string) string { return k.prefix + "queue:" + name }

// schedule is the sorted set of scheduled jobs, scored by float epoch seconds.
func (k sidekiqKeys) schedule() string { return k.prefix + "schedule" }
