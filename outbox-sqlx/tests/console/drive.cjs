// Drives the outbox console in headless Chromium, as an operator would: reads the status,
// finds the dead letter, opens it, requeues it with a reason. Takes a screenshot of each main
// page. Run by tests/console.rs: node drive.cjs <console url> <screenshot dir> <dead event id>
// (with CHROMIUM naming the browser, and playwright-core on NODE_PATH).
"use strict";
const { chromium } = require("playwright-core");
const path = require("path");

const [url, shots, eventId] = process.argv.slice(2);
const origin = new URL(url).origin;

function check(condition, what) {
  if (!condition) throw new Error("expected: " + what);
  console.log("ok: " + what);
}

(async () => {
  const browser = await chromium.launch({
    executablePath: process.env.CHROMIUM,
    args: ["--no-sandbox"],
  });
  try {
    const page = await browser.newPage({ viewport: { width: 1280, height: 820 } });
    const errors = [];
    const elsewhere = [];
    page.on("pageerror", (e) => errors.push(e.message));
    page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });
    page.on("request", (r) => { if (!r.url().startsWith(origin)) elsewhere.push(r.url()); });
    const shot = (name) => page.screenshot({ path: path.join(shots, name + ".png"), fullPage: true });

    // The overview: the status, one dead letter, what holds work back, charts with points.
    await page.goto(url);
    await page.waitForSelector("#stat-dead-letters");
    check((await page.textContent("#stat-dead-letters")) === "2", "the status shows 2 dead letters");
    check((await page.textContent("#mode")) === "writable", "the console says it is writable");
    await page.waitForSelector('tr[data-cause="dead delivery"]');
    await page.waitForSelector('tr[data-cause="parked event"]');
    await page.waitForSelector('tr[data-cause="dead event"]');
    check(true, "held back: a dead delivery, a parked event, a dead event");
    await page.waitForSelector('[data-chart="pending"] polyline', { state: "attached" });
    check(true, "the pending chart has points");
    await shot("overview");

    // Any state a page at a time: two dead letters, one per page, there and back.
    await page.goto(url + "#browse?state=dead&limit=1");
    const first = await page.locator("tr.row").getAttribute("data-event");
    await page.click("button.next");
    await page.waitForFunction((id) => {
      const rows = document.querySelectorAll("tr.row");
      return rows.length === 1 && rows[0].dataset.event !== id;
    }, first);
    check(!(await page.locator("button.next").count()), "the second page is the last");
    await page.click("button.previous");
    await page.waitForFunction((id) => {
      const rows = document.querySelectorAll("tr.row");
      return rows.length === 1 && rows[0].dataset.event === id;
    }, first);
    check(true, "a page at a time, there and back");

    // Failure groups: one line per failure; the undecodable event's group is requeued whole.
    await page.goto(url + "#groups");
    await page.waitForSelector("tr.group");
    check((await page.locator("tr.group").count()) === 2, "two failure groups");
    await shot("groups");
    const group = page.locator("tr.group", { hasText: "cannot decode: no data" });
    await group.locator("input.reason").fill("the decoder is fixed");
    await group.locator("button.requeue").click();
    await page.waitForFunction(() => document.getElementById("flash").textContent.startsWith("requeued"));
    check((await page.textContent("#flash")).startsWith("requeued 1"), "the group requeue says it requeued 1");
    await page.waitForFunction(() => document.querySelectorAll("tr.group").length === 1);
    check(true, "one failure group is left");

    // Parked: the Pong no running build routes.
    await page.goto(url + "#parked");
    await page.waitForSelector("tr.row");
    check((await page.locator("tr.row").count()) === 1, "one parked event");
    await shot("parked");

    // Dead letters: open the dead one, see its payload and error, requeue it with a reason.
    await page.goto(url + "#dead");
    const row = page.locator(`tr.row[data-event="${eventId}"]`);
    await row.waitFor();
    check((await row.getAttribute("data-subscriber")) === "y", "the dead letter is y's");
    await row.click();
    const detail = page.locator(`tr.row[data-event="${eventId}"] + tr.detail`);
    await detail.locator("pre.payload").waitFor();
    check((await detail.locator("pre.payload").textContent()).includes('"version"'), "its payload is shown");
    check((await detail.locator("pre.error").textContent()).includes("permanent error"), "its error is shown");
    await detail.locator("input.reason").fill("the licensing bug is fixed in 1.4.2");
    await shot("dead-letters");
    await detail.locator("button.requeue").click();
    await page.waitForFunction(() => document.getElementById("flash").textContent.startsWith("requeued"));
    check((await page.textContent("#flash")).startsWith("requeued 1"), "it says it requeued 1");
    await page.waitForSelector("#empty");
    check(true, "the dead letters list is empty after the requeue");

    // History: both requeues, newest first, with their reasons.
    await page.goto(url + "#history");
    await page.waitForSelector("tr.requeue-record");
    const reasons = await page.locator("tr.requeue-record td:last-child").allTextContents();
    check(
      JSON.stringify(reasons) === JSON.stringify(["the licensing bug is fixed in 1.4.2", "the decoder is fixed"]),
      "the history shows both requeues with their reasons: " + JSON.stringify(reasons));

    check(errors.length === 0, "no script errors: " + errors.join("; "));
    check(elsewhere.length === 0, "nothing fetched from another origin: " + elsewhere.join(", "));
  } finally {
    await browser.close();
  }
})().catch((e) => {
  console.error(e.stack || String(e));
  process.exit(1);
});
