package relay

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay/internal/handoff"
	targets "github.com/stagedrain/stagedrain/relay/internal/target"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// Rows of the gem's table that a batch puts back (deferred by Redis, or
// poison) come back unchanged: id, payload byte for byte (json keeps its
// text), created_at and updated_at to the microsecond, and a column the
// app added. The gem's payload column is json (its first migration) or
// jsonb (its later one).
func TestStagedPushReinsertUnchanged(t *testing.T) {
	t.Parallel()
	for _, typ := range []string{"json", "jsonb"} {
		t.Run(typ, func(t *testing.T) {
			t.Parallel()
			testStagedPushReinsert(t, typ)
		})
	}
}

func testStagedPushReinsert(t *testing.T, typ string) {
	ctx := context.Background()
	conn := testenv.Conn(t, testenv.DatabaseURL())
	schema := testenv.Schema(t)
	s := pgx.Identifier{schema}.Sanitize()
	if _, err := conn.Exec(ctx, `CREATE SCHEMA `+s+`;
		CREATE TABLE `+s+`.sidekiq_staged_push_jobs (
			id bigserial PRIMARY KEY,
			payload `+typ+` NOT NULL,
			created_at timestamp(6) without time zone NOT NULL,
			updated_at timestamp(6) without time zone NOT NULL,
			note text
		);
		INSERT INTO `+s+`.sidekiq_staged_push_jobs (payload, created_at, updated_at, note) VALUES
			('{"class":"A",  "args":[1, 2.50, "é\u0041"], "x": {"b":1,"a":2}}', '2026-11-30 06:00:00.123456', '2026-11-30 06:00:01.000001', 'n'),
			('[1,2]', '1999-01-01 00:00:00', '2026-01-01 00:00:00', NULL),
			('{"class":"B","args":[],"at":1e400}', '2026-11-30 06:00:00', '2026-11-30 06:00:00', 'quote '' and "')`); err != nil {
		t.Fatal(err)
	}
	read := func() string {
		t.Helper()
		var out string
		if err := conn.QueryRow(ctx, `SELECT string_agg(format('%s|%s|%s|%s|%s', id, payload::text, created_at, updated_at, note), E'\n' ORDER BY id)
			FROM `+s+`.sidekiq_staged_push_jobs`).Scan(&out); err != nil {
			t.Fatal(err)
		}
		return out
	}
	before := read()
	src := newStagedPushSource(schema)
	// The due-only claim leaves the row whose at is far ahead.
	for i, claim := range []string{src.sql.claim, src.sql.claimDue} {
		jobs, err := claimBatch(ctx, conn, claim, src.scan, 10, nil, fromStart, nil, []string{})
		if err != nil {
			t.Fatal(err)
		}
		if want := 3 - i; len(jobs) != want {
			t.Fatalf("claim #%d: %d rows, want %d", i+1, len(jobs), want)
		}
		if jobs[0].bad != "" || jobs[1].bad == "" || (i == 0 && jobs[2].bad == "") {
			t.Errorf("poison reasons %+v, want the first row good and the others poison", jobs)
		}
		sql, args := src.reinsert(jobs)
		if _, err := conn.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("reinsert: %v", err)
		}
		if _, err := conn.Exec(ctx, "COMMIT"); err != nil {
			t.Fatal(err)
		}
		if after := read(); after != before {
			t.Fatalf("rows after reinsert:\n%s\nwant:\n%s", after, before)
		}
	}
	var us *int64
	if err := conn.QueryRow(ctx, src.sql.nextDue).Scan(&us); err != nil || us == nil || *us != 86400e6 {
		t.Errorf("nextDue with an at of 1e400: %v (%v), want a day", us, err)
	}
}

// mapStagedPush completes a raw Sidekiq job hash as Sidekiq's client would,
// and says why a hash no worker could run is poison.
func TestMapStagedPush(t *testing.T) {
	created := 1795953600.5
	now := time.Unix(1795953700, 0)
	var j stagedJob
	mapStagedPush(&j, []byte(`{"class":"W","args":[1],"created_at":1795953000.25,"enqueued_at":5,"retry":false,"bid":"x","at":1795953800.5}`), &created, now)
	if j.bad != "" || j.name != "W" || string(j.args) != "[1]" || j.queue != "default" || len(j.jid) != 24 ||
		!j.createdAt.Equal(time.UnixMicro(1795953000250000)) || j.runAt == nil || !j.runAt.Equal(time.UnixMicro(1795953800500000)) ||
		string(j.options) != `{"bid":"x","retry":false}` {
		t.Errorf("mapped %+v", j)
	}
	mapStagedPush(&j, []byte(`{"class":"W","args":[1],"created_at":1795953000250}`), nil, now)
	if !j.createdAt.Equal(time.UnixMicro(1795953000250000)) || string(j.options) != "{}" {
		t.Errorf("integer milliseconds created_at: %+v", j)
	}
	mapStagedPush(&j, []byte(`{"class":"W","args":[1]}`), nil, now)
	if !j.createdAt.Equal(now) {
		t.Errorf("no created_at anywhere: %v, want now", j.createdAt)
	}
	b, err := sidekiqPayload(t, j, now)
	if err != nil || !strings.Contains(b, `"retry":true`) {
		t.Errorf("payload %s (%v), want retry true", b, err)
	}
	// The column's epoch of 'infinity' and '-infinity'.
	for _, c := range []float64{math.Inf(1), math.Inf(-1)} {
		mapStagedPush(&j, []byte(`{"class":"W","args":[1]}`), &c, now)
		if want := fmt.Sprintf("created_at is %s: Go and the job systems cannot hold it", map[bool]string{true: "infinity", false: "-infinity"}[c > 0]); j.bad != want {
			t.Errorf("created_at column %v: bad %q, want %q", c, j.bad, want)
		}
	}
	for payload, reason := range map[string]string{
		`null`:                                       "not a JSON object",
		`{"class":1,"args":[]}`:                      `"class" is not a non-empty string`,
		`{"class":"","args":[]}`:                     `"class" is not a non-empty string`,
		`{"class":"W"}`:                              `"args" is not a JSON array`,
		`{"class":"W","args":{}}`:                    `"args" is not a JSON array`,
		`{"class":"W","args":[],"queue":""}`:         `"queue" is not a non-empty string`,
		`{"class":"W","args":[],"jid":7}`:            `"jid" is not a non-empty string`,
		`{"class":"W","args":[],"at":"1"}`:           `"at" is not a number`,
		`{"class":"W","args":[],"at":null}`:          `"at" is not a number`,
		`{"class":"W","args":[],"at":1e300}`:         `"at" is out of range`,
		`{"class":"W","args":[],"at":-1e13}`:         `"at" is out of range`,
		`{"class":"W","args":[],"created_at":1e300}`: `"created_at" is out of range`,
	} {
		mapStagedPush(&j, []byte(payload), &created, now)
		if !strings.Contains(j.bad, reason) {
			t.Errorf("%s: reason %q, want %q", payload, j.bad, reason)
		}
		if _, err := sidekiqPayload(t, j, now); err == nil {
			t.Errorf("%s: the sidekiq target built a payload of a poison row", payload)
		}
		if _, err := checkJob(&j); err == nil {
			t.Errorf("%s: checkJob passed a poison row", payload)
		}
	}
}

// sidekiqPayload is the job hash the sidekiq target writes for j (pushed
// at now), or why the relay refuses the row.
func sidekiqPayload(t *testing.T, j stagedJob, now time.Time) (string, error) {
	t.Helper()
	var u handoff.Unit
	var res pushResult
	builtin(TargetSidekiq, targets.Options{MaxPayload: 1 << 20}).add(&u, []stagedJob{j}, now, &res)
	if len(res.rejected) > 0 {
		return "", errors.New(res.rejected[0].reason)
	}
	ops := opsOf(t, &u)
	last := ops[len(ops)-1].Commands[0]
	return last.Args[len(last.Args)-1].(string), nil
}
