// The README's "From Node" example, run by relay/bullmq_test.go: a BullMQ
// job staged in the app's transaction with node-postgres. DATABASE_URL and
// SCHEMA (set as the search_path) come from the test; ROLLBACK=1 rolls the
// transaction back instead of committing it. It prints the staged job's
// jid when it commits. The test checks that the lines between the markers,
// but for those ending "// test only", are the README's example.
"use strict";
const { Pool } = require("pg");

async function main() {
  const pool = new Pool({ connectionString: process.env.DATABASE_URL });
  pool.on("connect", (c) => c.query(`SET search_path TO "${process.env.SCHEMA}"`));
  const email = "ada@example.com";
  // --- the README's example, from here
  const client = await pool.connect();
  try {
    await client.query("BEGIN");
    const { rows } = await client.query(
      "INSERT INTO staged_jobs (job_name, job_args, queue, options) VALUES ($1, $2, $3, $4) RETURNING jid",
      ["welcome", JSON.stringify([{ email }]), "mailers", { unwrapData: true, attempts: 3 }]);
    // ... the app's own writes, in the same transaction ...
    if (process.env.ROLLBACK === "1") throw new Error("rolled back"); // test only
    await client.query("COMMIT");
    console.log(rows[0].jid); // test only
  } catch (err) { await client.query("ROLLBACK"); throw err; } finally { client.release(); }
  // --- to here
  await pool.end();
}

main().catch((err) => {
  if (err.message === "rolled back") process.exit(0);
  process.stderr.write(`${err.stack || err}\n`);
  process.exit(1);
});
