package relay

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"
)

// horizonSQL finds what holds the database's xmin horizon back the most
// (the oldest xmin): rows deleted since cannot be removed, by VACUUM or by
// any scan, while it stays. Those are a session of this database (a
// snapshot: pg_dump, a report, a REPEATABLE READ transaction left idle; or
// a transaction that wrote), a prepared transaction, a replication slot's
// xmin, a standby's hot_standby_feedback. A logical slot's catalog_xmin
// holds back the system catalogs only, not staged_jobs, so it is not
// looked at. Age is that of the holder's transaction (a session's or a
// prepared one's), NULL for a slot or a standby, which carry no time (the
// relay counts from when it first saw their xmin). $1 are the schemas of
// the drained tables (NULL: any), $2 the table's name; the last column is
// their dead rows (pg_stat_user_tables.n_dead_tup).
//
// A role without pg_read_all_stats (or pg_monitor) sees other roles'
// sessions' pid, application_name and xmin, but not their state, client,
// query or transaction start (the age is then NULL: counted from when
// the relay first saw the xmin). README, "Least-privilege role".
const horizonSQL = `WITH h AS (
	SELECT 'session' AS kind, pid, application_name AS name,
		coalesce(host(client_addr), CASE WHEN client_port = -1 THEN 'local' END) AS client, state,
		extract(epoch FROM now() - coalesce(xact_start, query_start))::float8 AS age,
		greatest(age(backend_xmin), age(backend_xid)) AS xids,
		CASE WHEN query <> '<insufficient privilege>' THEN left(query, 300) END AS query,
		coalesce(backend_xmin, backend_xid)::text AS xmin
	FROM pg_stat_activity
	WHERE datname = current_database() AND pid <> pg_backend_pid()
		AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)
	UNION ALL
	SELECT 'prepared transaction', NULL, gid, NULL, 'prepared', extract(epoch FROM now() - prepared)::float8,
		age(transaction), NULL, transaction::text
	FROM pg_prepared_xacts WHERE database = current_database()
	UNION ALL
	SELECT 'replication slot', active_pid, slot_name, NULL, CASE WHEN active THEN 'active' ELSE 'inactive' END, NULL,
		age(xmin), NULL, xmin::text
	FROM pg_replication_slots WHERE xmin IS NOT NULL
	UNION ALL
	SELECT 'standby', pid, application_name, host(client_addr), state, NULL,
		age(backend_xmin), NULL, backend_xmin::text
	FROM pg_stat_replication WHERE backend_xmin IS NOT NULL
)
SELECT kind, pid, name, client, state, age, query, xmin,
	(SELECT coalesce(sum(n_dead_tup), 0)::bigint FROM pg_stat_user_tables
		WHERE relname = $2 AND ($1::text[] IS NULL OR schemaname = ANY($1::text[])))
FROM h ORDER BY xids DESC NULLS LAST LIMIT 1`

// holderAge is how long a holder has held the horizon: the age horizonSQL
// read (seconds; nil for a slot or a standby, or without
// pg_read_all_stats), else seen, the time since the relay first saw its
// xmin. Never below 0: horizonSQL's now() is its own transaction's start,
// and a session whose transaction began after it (the app's, under load)
// read -0.008 s.
func holderAge(read *float64, seen time.Duration) time.Duration {
	age := seen
	if read != nil {
		age = time.Duration(*read * float64(time.Second))
	}
	return max(age, 0)
}

// horizonCheckEvery is how often the relay looks at the xmin horizon.
const horizonCheckEvery = 5 * time.Second

// horizonHolder is a row of horizonSQL.
type horizonHolder struct {
	kind                       string
	pid                        *int32
	name, client, state, query *string
	age                        *float64
	xmin                       string
	deadRows                   int64
}

func (h *horizonHolder) key() string {
	pid := int32(0)
	if h.pid != nil {
		pid = *h.pid
	}
	return fmt.Sprintf("%s/%d/%s/%s", h.kind, pid, str(h.name), h.xmin)
}

func str(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// horizonWatch remembers the holders it saw, so that it warns once per
// holder: when two take turns at the oldest xmin, neither is named twice.
type horizonWatch struct {
	seen    map[string]*horizonSeen // by horizonHolder.key
	schemas []string                // nil: any schema
	table   string
}

type horizonSeen struct {
	since, last time.Time // first and last seen as the oldest
	warned      bool
}

// watchHorizon looks at the database's xmin horizon every
// horizonCheckEvery until ctx ends: it sets the metric
// stagedrain_xmin_horizon_age_seconds, and logs one warn line when a
// holder has held it for HorizonWarnAfter (see horizonSQL).
func (r *Relay) watchHorizon(ctx context.Context, pool *pgxpool.Pool, w *horizonWatch) {
	log := r.log.Named("horizon")
	w.seen = map[string]*horizonSeen{}
	for sleep(ctx, jitter(min(horizonCheckEvery, max(r.cfg.HorizonWarnAfter/2, 10*time.Millisecond)))) {
		var h horizonHolder
		err := pool.QueryRow(ctx, horizonSQL, w.schemas, w.table).Scan(&h.kind, &h.pid, &h.name, &h.client,
			&h.state, &h.age, &h.query, &h.xmin, &h.deadRows)
		now := time.Now()
		// Forget holders not seen for as long as the threshold (a minute at
		// least: checks under load come late).
		for k, s := range w.seen {
			if now.Sub(s.last) > max(r.cfg.HorizonWarnAfter, time.Minute) {
				if s.warned {
					log.Info("xmin horizon no longer held back by the holder warned about", zap.String("holder", k))
				}
				delete(w.seen, k)
			}
		}
		if err != nil {
			if ctx.Err() == nil && !errors.Is(err, pgx.ErrNoRows) {
				log.Debug("could not read the xmin horizon", zap.Error(err))
			}
			r.metrics.horizonAge.Set(0)
			continue
		}
		s := w.seen[h.key()]
		if s == nil {
			s = &horizonSeen{since: now}
			w.seen[h.key()] = s
		}
		s.last = now
		age := holderAge(h.age, now.Sub(s.since))
		r.metrics.horizonAge.Set(age.Seconds())
		if age < r.cfg.HorizonWarnAfter || s.warned {
			continue
		}
		s.warned = true
		fields := []zap.Field{zap.String("holder", h.kind), zap.Duration("age", age.Round(time.Second)),
			zap.String("xmin", h.xmin), zap.Int64("dead_rows", h.deadRows), zap.String("table", w.table)}
		if h.pid != nil {
			fields = append(fields, zap.Int32("backend_pid", *h.pid))
		}
		fields = append(fields, zap.String("application_name", str(h.name)), zap.String("client", str(h.client)),
			zap.String("state", str(h.state)))
		if h.query != nil {
			fields = append(fields, zap.String("query", *h.query))
		}
		log.Warn("xmin horizon held back: dead rows cannot be removed until it ends", fields...)
	}
}

// startHorizonWatch runs watchHorizon for w until the returned stop is
// called; stop waits for it. HorizonWarnAfter < 0 turns it off.
func (r *Relay) startHorizonWatch(ctx context.Context, pool *pgxpool.Pool, w *horizonWatch) (stop func()) {
	if r.cfg.HorizonWarnAfter < 0 {
		return func() {}
	}
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		r.watchHorizon(ctx, pool, w)
	}()
	return func() {
		cancel()
		wg.Wait()
		r.metrics.horizonAge.Set(0)
	}
}
