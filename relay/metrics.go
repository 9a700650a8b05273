package relay

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// metrics are a Relay's Prometheus metrics, in a registry of its own (not
// the global default one), so that several relays in one process do not
// collide. Every child of a labelled metric that the drain touches is
// resolved once and kept, so counting a job costs no allocation.
type metrics struct {
	reg    *prometheus.Registry
	target string // the target label of jobs_pushed_total: "sidekiq"

	pushed    *prometheus.CounterVec // queue, target
	batches   prometheus.Counter
	batchSize prometheus.Histogram
	batchDur  prometheus.Histogram
	latency   latencyHistogram
	dead      prometheus.Counter
	leader    prometheus.Gauge
	// horizonAge is how long the database's xmin horizon has been held
	// back by what holds it back the most (horizon.go); database-wide.
	horizonAge prometheus.Gauge
	// labelled registers on reg with the schema (and queues) labels.
	labelled prometheus.Registerer
	// backpressure is 1 for a queue (and reason) whose pushes are paused.
	backpressure *prometheus.GaugeVec

	wakeNotify, wakePoll, wakeReconnect, wakeLate, wakeHot prometheus.Counter

	errs                                          *prometheus.CounterVec
	errRedis, errPostgres, errLostLock, errFenced prometheus.Counter

	// The per-queue counters of jobs_pushed_total and one batch's counts,
	// guarded by the summary's mutex, which job and batch are called under.
	queues  map[string]*queueCount
	touched []*queueCount
}

// latencyHistogram is stagedrain_job_latency_seconds, kept under the
// summary's mutex, which the drain holds anyway while it counts a batch: a
// job costs a bucket search and two additions, and no atomic operation, as
// a prometheus.Histogram's Observe would.
type latencyHistogram struct {
	mu     *sync.Mutex                     // the summary's
	counts [len(latencyBuckets) + 1]uint64 // per bucket, not cumulative; the last: above every bound
	sum    float64                         // seconds
}

// latencyBuckets are secondsBuckets as durations, for the search per job.
var latencyBuckets = func() (b [14]time.Duration) {
	for i, s := range secondsBuckets {
		b[i] = time.Duration(s * float64(time.Second))
	}
	return b
}()

var latencyDesc = prometheus.NewDesc("stagedrain_job_latency_seconds",
	"Time from a pushed job's created_at (its INSERT statement's start) to its push.", nil, nil)

// observe counts a job's latency; h.mu is held.
func (h *latencyHistogram) observe(d time.Duration) {
	d = max(d, 0)
	i := 0
	for i < len(latencyBuckets) && d > latencyBuckets[i] {
		i++
	}
	h.counts[i]++
	h.sum += float64(d) * 1e-9 // not d.Seconds(): no integer division
}

func (h *latencyHistogram) Describe(ch chan<- *prometheus.Desc) { ch <- latencyDesc }

func (h *latencyHistogram) Collect(ch chan<- prometheus.Metric) {
	h.mu.Lock()
	counts, sum := h.counts, h.sum
	h.mu.Unlock()
	buckets := make(map[float64]uint64, len(secondsBuckets))
	var n uint64
	for i, bound := range secondsBuckets {
		n += counts[i]
		buckets[bound] = n
	}
	n += counts[len(secondsBuckets)]
	ch <- prometheus.MustNewConstHistogram(latencyDesc, n, sum, buckets)
}

// queueCount is one queue's counter and its jobs in the batch being counted.
type queueCount struct {
	name string
	c    prometheus.Counter
	n    int
}

// Bucket upper bounds, in seconds and in jobs.
var (
	// A job's time from created_at to its push, and a batch's from claim
	// to commit: 0.5ms to 10s.
	secondsBuckets = []float64{0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10}
	// Jobs claimed per batch, up to the largest BatchSize.
	batchSizeBuckets = []float64{1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000}
)

// newMetrics returns the metrics of a relay pushing to target, with the
// backlog gauges sampled by b; mu is the mutex that job and batch are
// called under (the summary's).
//
// Every metric has the label schema (the relay's Config.Schema), so that
// the metrics of many schemas (Config.Schemas) can be served together, and,
// for a relay with Config.Queues, the label queues, its group (the sorted
// list, comma-joined), so that a group's leader is told from another's
// ("no leader" is per schema and group).
func newMetrics(target, schema, group string, b *backlog, mu *sync.Mutex) *metrics {
	m := &metrics{reg: prometheus.NewRegistry(), target: target, queues: make(map[string]*queueCount)}
	m.pushed = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "stagedrain_jobs_pushed_total",
		Help: "Jobs pushed to the target (their row deleted), by queue and target.",
	}, []string{"queue", "target"})
	m.batches = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "stagedrain_batches_total",
		Help: "Batches committed: claimed, pushed, dead rows buried, deferred rows put back.",
	})
	m.batchSize = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "stagedrain_batch_size",
		Help:    "Rows claimed per committed batch.",
		Buckets: batchSizeBuckets,
	})
	m.batchDur = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "stagedrain_batch_duration_seconds",
		Help:    "Time from a batch's claim to its commit.",
		Buckets: secondsBuckets,
	})
	m.latency.mu = mu
	m.dead = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "stagedrain_jobs_dead_lettered_total",
		Help: "Poison rows moved to staged_jobs_dead.",
	})
	m.leader = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "stagedrain_leader",
		Help: "1 while this relay holds its leader lock (the schema's, or its group's with --queues) and drains, else 0.",
	})
	m.horizonAge = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "stagedrain_xmin_horizon_age_seconds",
		Help: "How long the database's xmin horizon has been held back by what holds it back the most (a session's snapshot or transaction, a prepared transaction, a replication slot, a standby's hot_standby_feedback), 0 when nothing does; rows deleted since cannot be removed meanwhile. Checked every 5s.",
	})
	wakeups := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "stagedrain_wakeups_total",
		Help: "Wake-up signals to the drain loop by cause: notify (a NOTIFY arrived), poll (the fallback poll), reconnect (the listener's LISTEN, first or again), late_commit (a transaction in progress when the relay went idle ended: it may have staged jobs without notifying), hot_poll (a fleet of schemas running hot polled them all and found rows in this one).",
	}, []string{"cause"})
	m.wakeNotify = wakeups.WithLabelValues("notify")
	m.wakePoll = wakeups.WithLabelValues("poll")
	m.wakeReconnect = wakeups.WithLabelValues("reconnect")
	m.wakeLate = wakeups.WithLabelValues("late_commit")
	m.wakeHot = wakeups.WithLabelValues("hot_poll")
	m.errs = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "stagedrain_errors_total",
		Help: "Failures by kind: redis (a batch's push, or a PING), postgres (a batch, a database session, the listener, the backlog query), lost_lock (the leader lost its lock connection), fenced (the fence refused a push: another relay leads).",
	}, []string{"kind"})
	m.errRedis = m.errs.WithLabelValues("redis")
	m.errPostgres = m.errs.WithLabelValues("postgres")
	m.errLostLock = m.errs.WithLabelValues("lost_lock")
	m.errFenced = m.errs.WithLabelValues("fenced")

	m.backpressure = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "stagedrain_backpressure",
		Help: "1 while backpressure pauses pushes to a queue, by reason: queue_length (the queue holds --max-queue-length jobs or more), memory (Redis's used_memory / maxmemory is at or above --redis-max-memory-ratio; queue \"*\", every queue); 0 once resumed.",
	}, []string{"queue", "reason"})
	b.errs = m.errPostgres
	labels := prometheus.Labels{"schema": schema}
	if group != "" {
		labels["queues"] = group
	}
	// Every series carries the schema label, the horizon's age too (a
	// fleet serves that one once, without it: fleet.go).
	m.labelled = prometheus.WrapRegistererWith(labels, m.reg)
	m.labelled.MustRegister(
		m.pushed, m.batches, m.batchSize, m.batchDur, &m.latency, m.dead, m.leader,
		wakeups, m.errs, m.backpressure, backlogCollector{b}, m.horizonAge)
	return m
}

// job counts a pushed job of a batch being counted, with its latency.
func (m *metrics) job(j *stagedJob, latency time.Duration) {
	m.latency.observe(latency)
	// A batch holds few queues: look among them before hashing the name.
	var q *queueCount
	for _, t := range m.touched {
		if t.name == j.queue {
			q = t
			break
		}
	}
	if q == nil {
		q = m.queues[j.queue]
	}
	if q == nil {
		q = &queueCount{name: j.queue, c: m.pushed.WithLabelValues(j.queue, m.target)}
		m.queues[j.queue] = q
	}
	if q.n == 0 {
		m.touched = append(m.touched, q)
	}
	q.n++
}

// batch ends the counting of a batch of claimed rows that took d, dead of
// them dead-lettered.
func (m *metrics) batch(claimed, dead int, d time.Duration) {
	for _, q := range m.touched {
		q.c.Add(float64(q.n))
		q.n = 0
	}
	m.touched = m.touched[:0]
	m.batches.Inc()
	m.batchSize.Observe(float64(claimed))
	m.batchDur.Observe(d.Seconds())
	if dead > 0 {
		m.dead.Add(float64(dead))
	}
}

// targetError marks an error of the push to the target (Redis), for
// stagedrain_errors_total's kind; its message is err's.
type targetError struct{ error }

func (e targetError) Unwrap() error { return e.error }

// batchFailed counts a failed batch by its cause.
func (m *metrics) batchFailed(err error) {
	switch {
	case errors.Is(err, errLostLock):
		m.errLostLock.Inc()
	case errors.As(err, new(targetError)):
		m.errRedis.Inc()
	default:
		m.errPostgres.Inc()
	}
}

// sessionFailed counts a failed database session (campaign).
func (m *metrics) sessionFailed(err error) {
	switch {
	case errors.Is(err, errLostLock):
		m.errLostLock.Inc()
	case errors.Is(err, errFenced):
		m.errFenced.Inc()
	default:
		m.errPostgres.Inc()
	}
}

// MetricsHandler serves r's Prometheus metrics (stagedrain_*) in the text
// exposition format, for a GET /metrics. stagedrain run mounts it on its
// --metrics-addr listener, with Go's and the process's own metrics added;
// a program that embeds a Relay can mount it on its own mux, or gather the
// same metrics through MetricsGatherer. The backlog gauges cost a query on
// the leader's lock connection at most every 5s (see backlog).
func (r *Relay) MetricsHandler() http.Handler {
	return promhttp.HandlerFor(r.MetricsGatherer(), promhttp.HandlerOpts{})
}

// MetricsGatherer gathers r's metrics: to serve them with others
// (prometheus.Gatherers{r.MetricsGatherer(), myRegistry}) or to read them in
// a test. Each Relay has a registry of its own.
func (r *Relay) MetricsGatherer() prometheus.Gatherer {
	if r.fleet != nil {
		return fleetGatherer{r.fleet}
	}
	return r.metrics.reg
}

// backlog is the leader's sample of the backlog: staged rows, counted up to
// backlogCap, and the age of the oldest of the 100 lowest ids. It is taken
// on the leader's lock connection, for the summary line and for a scrape
// (at most one every backlogTTL), never on a standby, and never while
// nobody asks: an idle relay that nobody scrapes runs no backlog query.
type backlog struct {
	mu     sync.Mutex  // one sample at a time; guards the fields below
	conn   *pgx.Conn   // the lock connection while leading, else nil
	connMu *sync.Mutex // guards conn's use, shared with keepLock and the gate
	sql    string
	args   []any // sql's arguments after $1: the queues of a group
	// markSQL, with mark, counts from the low-water mark (lowwater.go)
	// instead: the rows above mark(), which returns fromStart while the
	// mark is off or knows nothing yet, then sql is used.
	markSQL string
	mark    func() int64
	ttl     time.Duration      // how long a scrape reuses a sample
	errs    prometheus.Counter // counts failed samples; nil: none

	last backlogSample
	err  error // of the last sample; cached for ttl like a success
}

// backlogSample is one backlog query's result.
type backlogSample struct {
	at     time.Time // when taken; zero: none yet in this term of leadership
	count  int       // staged rows, up to backlogCap
	oldest time.Time // created_at of the oldest of the 100 lowest ids; zero: none staged
	notify float64   // pg_notification_queue_usage(): the NOTIFY queue's fill, 0 to 1
}

// backlogTTL is how long a scrape reuses the leader's last backlog sample.
const backlogTTL = 5 * time.Second

// backlogTimeout bounds the backlog query, server side: PostgreSQL cancels
// it (statement_timeout) and the lock connection lives on. A count over a
// table that a large drain left full of dead tuples can take a while.
const backlogTimeout = time.Second

var errNotLeading = errors.New("not leading")

// attach makes conn (the leader's lock connection, used under connMu) the
// one samples are taken on, for this term of leadership.
func (b *backlog) attach(conn *pgx.Conn, connMu *sync.Mutex) {
	b.mu.Lock()
	b.conn, b.connMu, b.last, b.err = conn, connMu, backlogSample{}, nil
	b.mu.Unlock()
}

// detach ends the term: no more samples until the next attach. It waits
// for a sample in flight.
func (b *backlog) detach() {
	b.mu.Lock()
	b.conn, b.connMu, b.last, b.err = nil, nil, backlogSample{}, nil
	b.mu.Unlock()
}

// query returns the backlog statement and its arguments: from the low-water
// mark when it knows one, else from the index's start.
//
// From the mark, indexOnly is true: the sample then runs with sequential
// scans off, as the drain's sessions do, so that it starts in the id index
// at the mark, whatever the table's statistics say (a seq scan reads every
// dead row the mark steps over).
func (b *backlog) query() (sql string, args []any, indexOnly bool) {
	if b.mark != nil && b.markSQL != "" {
		if from := b.mark(); from != fromStart {
			return b.markSQL, append([]any{backlogCap, from}, b.args...), true
		}
	}
	return b.sql, append([]any{backlogCap}, b.args...), false
}

// sample returns a backlog sample taken less than maxAge ago, taking one
// if there is none; errNotLeading when the relay does not lead.
func (b *backlog) sample(ctx context.Context, maxAge time.Duration) (backlogSample, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.conn == nil {
		return backlogSample{}, errNotLeading
	}
	if !b.last.at.IsZero() && time.Since(b.last.at) < maxAge {
		return b.last, b.err
	}
	var s backlogSample
	var oldest *time.Time
	batch := &pgx.Batch{}
	// One implicit transaction: the setting ends with it.
	batch.Queue(`SELECT set_config('statement_timeout', $1, true)`, fmt.Sprint(backlogTimeout.Milliseconds()))
	query, args, indexOnly := b.query()
	if indexOnly {
		batch.Queue(`SELECT set_config('enable_seqscan', 'off', true), set_config('jit', 'off', true)`)
	}
	batch.Queue(query, args...).QueryRow(func(row pgx.Row) error { return row.Scan(&s.count, &oldest) })
	batch.Queue(notifyQueueUsageSQL).QueryRow(func(row pgx.Row) error { return row.Scan(&s.notify) })
	b.connMu.Lock()
	err := withTimeout(ctx, backlogTimeout+2*time.Second, func(ctx context.Context) error {
		return b.conn.SendBatch(ctx, batch).Close()
	})
	b.connMu.Unlock()
	s.at = time.Now()
	if oldest != nil {
		s.oldest = *oldest
	}
	if err != nil {
		if b.errs != nil {
			b.errs.Inc()
		}
	}
	b.last, b.err = s, err
	return s, err
}

// notifyQueueUsageSQL reads how full the server's NOTIFY queue is (all
// databases, 0 to 1). A listening session that never reads (frozen, or
// an app's LISTEN left in an open transaction) keeps every notification
// after its position queued; once the queue is full, every commit that
// notifies fails, the app's staging commits among them.
const notifyQueueUsageSQL = `SELECT pg_notification_queue_usage()`

// backlogCollector reports the leader's backlog sample as gauges (the
// backlog, its oldest job's age, and the NOTIFY queue's usage); a relay
// that does not lead, or whose last sample failed, reports none.
type backlogCollector struct{ b *backlog }

var (
	backlogDesc = prometheus.NewDesc("stagedrain_backlog_jobs",
		"Rows staged in staged_jobs, counted up to 10001 (10001 means that many or more); reported by the leader only, sampled at most every 5s.",
		nil, nil)
	oldestAgeDesc = prometheus.NewDesc("stagedrain_oldest_job_age_seconds",
		"Age of the oldest staged job (by created_at, among the 100 lowest ids) when sampled, 0 when none is staged; reported by the leader only, sampled at most every 5s.",
		nil, nil)
	notifyQueueDesc = prometheus.NewDesc("stagedrain_notify_queue_usage",
		"Fraction (0 to 1) of PostgreSQL's NOTIFY queue in use, pg_notification_queue_usage(), for the whole server: a listener that stops reading holds every later notification, and a full queue fails every commit that notifies; reported by the leader only, sampled at most every 5s.",
		nil, nil)
)

func (c backlogCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- backlogDesc
	ch <- oldestAgeDesc
	ch <- notifyQueueDesc
}

func (c backlogCollector) Collect(ch chan<- prometheus.Metric) {
	s, err := c.b.sample(context.Background(), c.b.ttl)
	if err != nil {
		return
	}
	age := 0.0
	if !s.oldest.IsZero() {
		age = max(s.at.Sub(s.oldest), 0).Seconds()
	}
	ch <- prometheus.MustNewConstMetric(backlogDesc, prometheus.GaugeValue, float64(s.count))
	ch <- prometheus.MustNewConstMetric(oldestAgeDesc, prometheus.GaugeValue, age)
	ch <- prometheus.MustNewConstMetric(notifyQueueDesc, prometheus.GaugeValue, s.notify)
}
