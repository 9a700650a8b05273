// The real BullMQ Worker of relay/bullmq_test.go: it runs every job of the
// queues in QUEUES (comma-separated) under the prefix PREFIX, on the Redis
// of REDIS_URL, and writes one JSON line per job it runs to stdout:
// {"queue","id","name","data","opts","timestamp","processedOn"}. It writes
// {"ready":true} once every worker is connected, and closes its workers and
// exits when stdin closes.
"use strict";
const { Worker } = require("bullmq");

const url = new URL(process.env.REDIS_URL);
const connection = {
  host: url.hostname,
  port: Number(url.port || 6379),
  db: Number((url.pathname || "/0").slice(1) || 0),
  username: decodeURIComponent(url.username) || undefined,
  password: decodeURIComponent(url.password) || undefined,
  maxRetriesPerRequest: null,
};
const prefix = process.env.PREFIX;
const queues = process.env.QUEUES.split(",");

function out(obj) {
  process.stdout.write(JSON.stringify(obj) + "\n");
}

async function main() {
  const workers = queues.map(
    (queue) =>
      new Worker(
        queue,
        async (job) => {
          out({
            queue: job.queueName,
            id: job.id,
            name: job.name,
            data: job.data,
            opts: job.opts,
            timestamp: job.timestamp,
            processedOn: job.processedOn,
          });
          return "ok";
        },
        // drainDelay: an idle worker waits up to 60s on the queue's marker
        // before it looks at the queue again, so a job whose push set no
        // marker is not run within the test's bounds.
        { connection, prefix, drainDelay: 60, concurrency: 4 },
      ),
  );
  for (const w of workers) {
    w.on("error", (err) => process.stderr.write(`worker error: ${err}\n`));
    await w.waitUntilReady();
  }
  out({ ready: true });
  process.stdin.resume();
  process.stdin.on("end", async () => {
    await Promise.all(workers.map((w) => w.close()));
    process.exit(0);
  });
}

main().catch((err) => {
  process.stderr.write(`${err.stack || err}\n`);
  process.exit(1);
});
