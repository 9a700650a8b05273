package relay_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/url"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// testCA writes, into a directory PostgreSQL's user can read, a CA
// certificate (ca.pem) and a server certificate for 127.0.0.1 signed by it
// (server.pem, server.key; owned by postgres when the test runs as root,
// as PostgreSQL wants its key).
func testCA(t *testing.T) (dir string) {
	t.Helper()
	dir, err := os.MkdirTemp("", "stagedrain-tls-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	ca := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "stagedrain test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, ca, ca, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	srvKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	srv := &x509.Certificate{
		SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "127.0.0.1"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, DNSNames: []string{"localhost"},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	srvDER, err := x509.CreateCertificate(rand.Reader, srv, ca, &srvKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(srvKey)
	if err != nil {
		t.Fatal(err)
	}
	for name, block := range map[string]*pem.Block{
		"ca.pem":     {Type: "CERTIFICATE", Bytes: caDER},
		"server.pem": {Type: "CERTIFICATE", Bytes: srvDER},
		"server.key": {Type: "EC PRIVATE KEY", Bytes: keyDER},
	} {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, pem.EncodeToMemory(block), 0o600); err != nil {
			t.Fatal(err)
		}
		if os.Geteuid() == 0 && name != "ca.pem" {
			pg, err := user.Lookup("postgres")
			if err != nil {
				t.Fatal(err)
			}
			uid, _ := strconv.Atoi(pg.Uid)
			gid, _ := strconv.Atoi(pg.Gid)
			if err := os.Chown(path, uid, gid); err != nil {
				t.Fatal(err)
			}
		}
	}
	return dir
}

// The README's TLS settings work: a relay whose database URL says
// sslmode=verify-full with sslrootcert, and whose Redis URL is rediss://
// (the CA trusted as SSL_CERT_FILE would make it), drains over TLS to both,
// and PostgreSQL sees its sessions encrypted. Its logs name both servers as
// without TLS, and never with the password.
func TestRelayOverTLS(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dir := testCA(t)
	pem := func(name string) string { return filepath.Join(dir, name) }

	pg := testenv.StartPostgres(t)
	admin := testenv.Conn(t, pg.URL())
	for _, sql := range []string{
		"ALTER SYSTEM SET ssl = on",
		"ALTER SYSTEM SET ssl_cert_file = '" + pem("server.pem") + "'",
		"ALTER SYSTEM SET ssl_key_file = '" + pem("server.key") + "'",
		"SELECT pg_reload_conf()",
	} {
		if _, err := admin.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	dbURL := fmt.Sprintf("postgres://postgres:s3cret-pg-pw@127.0.0.1:%d/postgres?sslmode=verify-full&sslrootcert=%s",
		pg.Port, url.QueryEscape(pem("ca.pem")))
	var conn *pgx.Conn
	testenv.WaitFor(t, 10*time.Second, "PostgreSQL to take TLS connections", func() (bool, string) {
		c, err := pgx.Connect(ctx, dbURL)
		if err != nil {
			return false, err.Error()
		}
		conn = c
		return true, ""
	})
	t.Cleanup(func() { conn.Close(context.Background()) })
	schema := testenv.SchemaNamedIn(t, pg.URL(), testenv.Name("sdtest_"))
	if _, err := relay.Migrate(ctx, conn, schema); err != nil {
		t.Fatal(err)
	}

	tlsPort := testenv.FreePort(t)
	testenv.StartRedis(t, "--tls-port", strconv.Itoa(tlsPort), "--tls-cert-file", pem("server.pem"),
		"--tls-key-file", pem("server.key"), "--tls-ca-cert-file", pem("ca.pem"), "--tls-auth-clients", "no")
	opts, err := redis.ParseURL(fmt.Sprintf("rediss://127.0.0.1:%d/0", tlsPort))
	if err != nil {
		t.Fatal(err)
	}
	// What SSL_CERT_FILE=ca.pem does for the whole process.
	roots := x509.NewCertPool()
	caPEM, err := os.ReadFile(pem("ca.pem"))
	if err != nil || !roots.AppendCertsFromPEM(caPEM) {
		t.Fatalf("read ca.pem: %v", err)
	}
	opts.TLSConfig.RootCAs = roots
	if opts.TLSConfig.ServerName != "127.0.0.1" || opts.TLSConfig.MinVersion != tls.VersionTLS12 {
		t.Fatalf("rediss:// TLS config %+v, want ServerName 127.0.0.1 and TLS 1.2 at least", opts.TLSConfig)
	}
	rdb := redis.NewClient(testenv.RedisOptions(opts))
	t.Cleanup(func() { rdb.Close() })

	jids, err := relay.NewStager(schema).StageMany(ctx, conn, []relay.Job{{Name: "OverTLSJob", Args: []any{1}}})
	if err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zapcore.DebugLevel)
	r, err := relay.New(relay.Config{DatabaseURL: dbURL, Redis: rdb, Schema: schema, Logger: zap.New(core)})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			cancel()
			if err := <-done; err != nil {
				t.Errorf("Run = %v, want nil after cancel", err)
			}
		}
	}
	defer stop()

	testenv.WaitFor(t, 15*time.Second, "the job in queue:default over TLS", func() (bool, string) {
		got, err := rdb.LRange(ctx, "queue:default", 0, -1).Result()
		return len(got) == 1 && strings.Contains(got[0], jids[0]), fmt.Sprintf("%q, %v; logs %v", got, err, messages(logs))
	})
	var sessions, encrypted int
	if err := conn.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE s.ssl) FROM pg_stat_activity a
		JOIN pg_stat_ssl s USING (pid) WHERE a.application_name LIKE 'stagedrain %'`).Scan(&sessions, &encrypted); err != nil {
		t.Fatal(err)
	}
	if sessions < 2 || encrypted != sessions {
		t.Errorf("%d of the relay's %d PostgreSQL sessions use TLS, want all (2 or more)", encrypted, sessions)
	}
	stop()
	starting := logs.FilterMessage("starting").All()
	if len(starting) != 1 {
		t.Fatalf("%d starting lines, want 1", len(starting))
	}
	f := starting[0].ContextMap()
	if want := fmt.Sprintf("postgres@127.0.0.1:%d/postgres", pg.Port); f["database"] != want {
		t.Errorf("starting line names the database %v, want %s", f["database"], want)
	}
	if want := fmt.Sprintf("127.0.0.1:%d/0", tlsPort); f["redis"] != want {
		t.Errorf("starting line names Redis %v, want %s", f["redis"], want)
	}
	for _, e := range logs.All() {
		if line := fmt.Sprint(e.Message, e.ContextMap()); strings.Contains(line, "s3cret-pg-pw") {
			t.Errorf("a log line shows the password: %s", line)
		}
	}
}
