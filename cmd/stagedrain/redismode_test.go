package main

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay/relaytest"
)

// stagedrain run --redis-mode cluster reads REDIS_URL as a cluster URL and
// drains streams jobs of several queues into a password-protected 3-master
// Redis Cluster, naming it by its seed addresses, never with its password.
func TestRunOnRedisCluster(t *testing.T) {
	t.Parallel()
	const password = "cluster-s3cret"
	cluster := relaytest.StartRedisCluster(t, "--requirepass", password, "--masterauth", password)
	var addrs []string
	for _, n := range cluster.Nodes {
		addrs = append(addrs, fmt.Sprintf("127.0.0.1:%d", n.Port))
	}
	url := fmt.Sprintf("redis://:%s@%s?addr=%s&addr=%s", password, addrs[0], addrs[1], addrs[2])
	o, err := redis.ParseClusterURL(url)
	if err != nil {
		t.Fatal(err)
	}
	o.DisableIdentity = true
	rdb := redis.NewClusterClient(o)
	defer rdb.Close()
	ctx := context.Background()

	e := newRelayEnv(t)
	p := startProc(t, "relay", childEnv("REDIS_URL="+url), "run", "--schema", e.schema,
		"--redis-namespace", e.ns, "--redis-mode", "cluster", "--target", "streams")
	_, err = e.conn.Exec(ctx, "INSERT INTO "+pgx.Identifier{e.schema, "staged_jobs"}.Sanitize()+
		" (job_name, job_args, queue) SELECT 'Work', jsonb_build_array(g), 'q' || (g % 4) FROM generate_series(1, 12) g")
	if err != nil {
		t.Fatal(err)
	}
	relaytest.WaitFor(t, 15*time.Second, "12 entries over 4 streams, none staged", func() (bool, string) {
		var n int64
		for q := range 4 {
			n += rdb.XLen(ctx, fmt.Sprintf("%s:stream:q%d", e.ns, q)).Val()
		}
		staged := stagedCount(t, e.conn, e.schema)
		return n == 12 && staged == 0, fmt.Sprintf("%d entries, %d staged", n, staged)
	})
	start := p.waitLog(rootLogger, "starting", 5*time.Second)
	if want := "cluster " + strings.Join(addrs, ","); start.str("redis") != want {
		t.Errorf("starting names Redis %q, want %q", start.str("redis"), want)
	}
	if out := p.output(); strings.Contains(out, password) {
		t.Errorf("the password shows in the output:\n%s", out)
	}
}

// stagedrain run --redis-mode sentinel finds the primary through Sentinel
// (the primary's password in the URL's password parameter) and drains into
// it.
func TestRunThroughSentinel(t *testing.T) {
	t.Parallel()
	const password = "primary-s3cret"
	primary := relaytest.StartRedis(t, "--requirepass", password).Port
	sentinel := relaytest.StartRedisSentinel(t, primary, "sentinel auth-pass mymaster "+password)
	ctx := context.Background()

	e := newRelayEnv(t)
	url := sentinel.URL() + "&password=" + password
	p := startProc(t, "relay", childEnv("REDIS_URL="+url, "STAGEDRAIN_REDIS_MODE=sentinel"), "run",
		"--schema", e.schema, "--redis-namespace", e.ns)
	jids := e.stage("Work", 3)
	direct := redis.NewClient(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", primary), Password: password, DisableIdentity: true})
	defer direct.Close()
	relaytest.WaitFor(t, 15*time.Second, "3 jobs on the primary, none staged", func() (bool, string) {
		got, err := direct.LRange(ctx, e.queueKey(), 0, -1).Result()
		staged := stagedCount(t, e.conn, e.schema)
		return err == nil && len(got) == 3 && staged == 0 && strings.Contains(strings.Join(got, ""), jids[2]),
			fmt.Sprintf("%d jobs (%v), %d staged", len(got), err, staged)
	})
	if start := p.waitLog(rootLogger, "starting", 5*time.Second); start.str("redis") != "sentinel primary/0" {
		t.Errorf("starting names Redis %q, want sentinel primary/0", start.str("redis"))
	}
	if out := p.output(); strings.Contains(out, password) {
		t.Errorf("the password shows in the output:\n%s", out)
	}
}
