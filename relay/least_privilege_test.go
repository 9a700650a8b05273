package relay_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// leastPrivilegeRole creates a role with the README's grants on h's schema
// and returns its name and its connection URL.
func leastPrivilegeRole(h *harness) (role, roleURL string) {
	h.t.Helper()
	role, roleURL = testenv.RoleIn(h.t, testenv.DatabaseURL(), "sdtest_role_")
	for _, g := range relay.ReadmeGrants(h.t, h.schema, role) {
		if _, err := h.conn.Exec(context.Background(), g); err != nil {
			h.t.Fatalf("%s: %v", g, err)
		}
	}
	return role, roleURL
}

// runFatal runs r until it returns, which must be within 15s, and returns
// Run's error.
func runFatal(t *testing.T, r *relay.Relay) error {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	select {
	case err := <-done:
		return err
	case <-time.After(15 * time.Second):
		cancel()
		<-done
		t.Fatal("Run still running after 15s, want it to fail")
		return nil
	}
}

// A relay whose role has only the README's grants drains: immediate,
// scheduled and poison jobs, the last both into an empty dead-letter slot
// and over a dead row of the same id (ON CONFLICT DO UPDATE).
func TestLeastPrivilegeRelay(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	role, roleURL := leastPrivilegeRole(h)
	ctx := context.Background()
	big := strings.Repeat("x", 600)
	jids := h.stageMany(
		relay.Job{Name: "LeastPrivJob", Args: []any{1}},
		relay.Job{Name: "LeastPrivJob", Args: []any{2}},
		relay.Job{Name: "LeastPrivJob", Args: []any{3}, RunAt: time.Now().Add(time.Hour)},
		relay.Job{Name: "TooBigJob", Args: []any{big}},
		relay.Job{Name: "TooBigJob", Args: []any{big, 2}},
	)
	// The last poison row's id is dead already (as if copied back by hand).
	if _, err := h.conn.Exec(ctx, "INSERT INTO "+pgx.Identifier{h.schema, "staged_jobs_dead"}.Sanitize()+
		" (id, reason, attempts) SELECT id, 'earlier', 1 FROM "+pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()+
		" WHERE jid = $1", jids[4]); err != nil {
		t.Fatal(err)
	}

	cfg := h.config()
	cfg.DatabaseURL = roleURL
	cfg.MaxPayloadBytes = 300
	h.start(cfg)
	h.waitQueueLen("default", 2, 15*time.Second)
	h.waitStaged(0)
	if got := h.queueJIDs("default"); len(got) != 2 || got[0] != jids[0] || got[1] != jids[1] {
		t.Errorf("queue:default holds %v, want %v", got, jids[:2])
	}
	if got, _ := h.scheduled(); len(got) != 1 || got[0].jid() != jids[2] {
		t.Errorf("schedule holds %v, want the job %s", got, jids[2])
	}
	dead := h.dead()
	if len(dead) != 2 || *dead[0].jid != jids[3] || dead[0].attempts != 1 || *dead[1].jid != jids[4] || dead[1].attempts != 2 {
		t.Errorf("staged_jobs_dead holds %+v, want %s (attempts 1) and %s (attempts 2, over the earlier row)", dead, jids[3], jids[4])
	}
	for _, msg := range []string{"batch failed, retrying", "database session failed, retrying", "stepped down"} {
		if n := h.logs.FilterMessage(msg).Len(); n != 0 {
			t.Errorf("logged %q %d times, want none; logs: %v", msg, n, messages(h.logs))
		}
	}
	// The relay's sessions are the role's.
	var sessions int
	if err := h.conn.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE usename = $1 AND application_name LIKE 'stagedrain %'",
		role).Scan(&sessions); err != nil {
		t.Fatal(err)
	}
	if sessions < 2 {
		t.Errorf("%d sessions of role %s, want the relay's (2 or more)", sessions, role)
	}
}

// A role without DELETE on staged_jobs: Run fails at once, before it leads,
// naming the missing privilege and the README's section, and the job stays
// staged.
func TestMissingPrivilegeFailsAtStart(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	role, roleURL := leastPrivilegeRole(h)
	table := pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()
	if _, err := h.conn.Exec(context.Background(), "REVOKE DELETE ON "+table+" FROM "+pgx.Identifier{role}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	h.stage(relay.Job{Name: "StaysStagedJob", Args: []any{}})
	cfg := h.config()
	cfg.DatabaseURL = roleURL
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	err = runFatal(t, r)
	want := `permission denied: role "` + role + `" lacks DELETE on ` + table + `: the relay's role needs USAGE on the schema; ` +
		`SELECT, INSERT, DELETE and UPDATE (id) on staged_jobs; SELECT, INSERT and UPDATE on staged_jobs_dead; ` +
		`SELECT on stagedrain_migrations (see README "Least-privilege role")`
	if !errors.Is(err, relay.ErrPermission) || err.Error() != want {
		t.Fatalf("Run = %v\nwant ErrPermission: %s", err, want)
	}
	if n := h.logs.FilterMessage("became leader").Len(); n != 0 {
		t.Errorf("the relay became leader without the privileges it needs")
	}
	if n := h.staged(); n != 1 {
		t.Errorf("%d rows staged, want 1", n)
	}
}

// A privilege revoked while the relay runs: the drain's claim is refused
// (SQLSTATE 42501), and Run returns that at once, as ErrPermission with the
// README's hint, instead of retrying it forever; the job stays staged.
func TestPrivilegeRevokedWhileRunning(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	role, roleURL := leastPrivilegeRole(h)
	cfg := h.config()
	cfg.DatabaseURL = roleURL
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	idle := make(chan int64, 100)
	relay.SetOnIdle(r, func(listens int64) { idle <- listens })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	select {
	case <-idle: // led, drained at start, and went idle
	case err := <-done:
		t.Fatalf("Run = %v before its first drain", err)
	case <-time.After(15 * time.Second):
		t.Fatal("the relay did not drain within 15s")
	}

	table := pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()
	if _, err := h.conn.Exec(context.Background(), "REVOKE DELETE ON "+table+" FROM "+pgx.Identifier{role}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	h.stage(relay.Job{Name: "StaysStagedJob", Args: []any{}})
	select {
	case err = <-done:
	case <-time.After(15 * time.Second):
		cancel()
		<-done
		t.Fatalf("Run still running 15s after DELETE was revoked; logs: %v", messages(h.logs))
	}
	if !errors.Is(err, relay.ErrPermission) || !strings.Contains(err.Error(), "permission denied for table staged_jobs (SQLSTATE 42501)") ||
		!strings.HasSuffix(err.Error(), `(see README "Least-privilege role")`) {
		t.Fatalf("Run = %v, want ErrPermission naming staged_jobs and pointing at the README", err)
	}
	if n := h.logs.FilterMessage("batch failed, retrying").Len(); n != 0 {
		t.Errorf("the refused batch was retried %d times, want none", n)
	}
	if n := h.staged(); n != 1 {
		t.Errorf("%d rows staged, want 1", n)
	}
}

// A privilege revoked while a relay stands by: when the leader stops, the
// standby checks its privileges again as it takes the lock (as a fleet
// checks each schema it takes), and Run fails with the missing privilege
// named, before it leads: it never becomes leader and claims nothing.
func TestStandbyChecksPrivilegesOnTakeover(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	role, roleURL := leastPrivilegeRole(h)
	table := pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()
	err := takeOverAfter(t, h, func() relay.Config {
		cfg := h.config()
		cfg.DatabaseURL = roleURL
		return cfg
	}, func() {
		if _, err := h.conn.Exec(context.Background(), "REVOKE DELETE ON "+table+" FROM "+pgx.Identifier{role}.Sanitize()); err != nil {
			t.Fatal(err)
		}
	})
	want := `permission denied: role "` + role + `" lacks DELETE on ` + table + `: `
	if !errors.Is(err, relay.ErrPermission) || !strings.HasPrefix(err.Error(), want) {
		t.Fatalf("standby Run = %v, want ErrPermission at takeover, starting %q", err, want)
	}
}
